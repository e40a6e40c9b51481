"""Bounded database waits for the flush, and who blocks a flush.

A flusher frozen inside its apply transaction (a VM paused, a host lost
without a TCP reset) keeps its row locks and its uncommitted ledger row. The
next flusher takes the shard once the lease expires, recovers the batch, and
its ledger insert queues behind the frozen one. So the apply transaction runs
under limits derived from the time budget and the lease (:func:`apply_limits`):

- PostgreSQL: ``SET LOCAL lock_timeout``, ``statement_timeout`` and
  ``idle_in_transaction_session_timeout``; the last one makes the server end
  a frozen flusher's session, which rolls its transaction back, so the next
  flush applies the batch (exactly once: the ledger row was never committed);
- MySQL/MariaDB: the session's ``innodb_lock_wait_timeout`` (whole seconds),
  statement limit (MariaDB's ``max_statement_time``, MySQL's
  ``max_execution_time``) and idle limit (MariaDB's ``idle_transaction_timeout``,
  which ends a frozen flusher's session as PostgreSQL does; MySQL's
  ``wait_timeout``), restored afterwards (:func:`mysql_limits`);
- SQLite: its busy timeout (``PRAGMA busy_timeout``), restored afterwards.

A lock or statement timeout is an ``OperationalError``: the batch stays in
flight, the shard fails this run, and the flush returns within its budget.
:func:`blocked_flushes` names the sessions a flush waits on, for
``counters_status``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, connections, transaction

from counters.base.registry import all_specs
from counters.models import BufferEpoch, FlushBatch
from counters.write.upserts.on_conflict import KEY_ORDER_SETTINGS, in_key_order

logger = logging.getLogger(__name__)

#: Shortest lock wait a flush is given, seconds (0 would mean "no limit" to PostgreSQL).
MIN_WAIT = 1.0
#: A flusher idle inside its transaction this long is frozen, whatever the lease (seconds).
MIN_IDLE = 60.0


@dataclass(frozen=True)
class Limits:
    """Seconds the apply transaction may wait for a lock, run a statement, and sit idle."""

    lock: float
    statement: float
    idle: float


def apply_limits(lease_timeout: float, remaining: float) -> Limits:
    """The limits of one apply transaction of a flusher holding a lease of ``lease_timeout``.

    Invariants: a lock wait ends within the time budget left (``remaining``,
    at least :data:`MIN_WAIT`), so ``--time-budget`` holds whatever holds the
    lock; a statement ends within that, or within the lease if that is
    longer (a big batch near the end of the budget still gets a lease's
    time); a session idle in the transaction for twice the lease (at least
    :data:`MIN_IDLE`) is frozen, and the server ends it. Waiting past the own
    lease is safe: a batch applied meanwhile by another flusher collides on
    the ledger's primary key and is only acknowledged.
    """
    lock = max(MIN_WAIT, remaining)
    return Limits(
        lock=lock,
        statement=max(lock, lease_timeout),
        idle=max(MIN_IDLE, 2 * lease_timeout),
    )


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


#: The limits :func:`atomic` applies in this thread or task (set by :func:`limited`).
_current: ContextVar[Limits | None] = ContextVar("counters_wait_limits", default=None)


@contextmanager
def limited(limits: Limits) -> Iterator[None]:
    """Make :func:`atomic` apply ``limits`` within the block (the flush loop sets them)."""
    token = _current.set(limits)
    try:
        yield
    finally:
        _current.reset(token)


@contextmanager
def atomic(using: str) -> Iterator[None]:
    """``transaction.atomic(using)`` under the limits of the enclosing :func:`limited`.

    PostgreSQL: ``SET LOCAL`` of the three timeouts, first thing in the
    transaction, with the planner settings that keep a batch's UPDATE in key
    order (:data:`counters.write.upserts.on_conflict.KEY_ORDER_SETTINGS`) when the
    transaction is its own: one round trip.
    MySQL/MariaDB: the session's three limits, set before BEGIN in one
    statement and put back after the transaction.
    SQLite: the session's lock wait (its ``BEGIN IMMEDIATE`` already waits
    for the lock). Without limits, a plain ``atomic``.
    """
    limits = _current.get()
    if limits is None:
        with transaction.atomic(using=using):
            yield
        return
    conn = connections[using]
    # PostgreSQL needs no session setting (and its two round trips per batch) here.
    outer = session(using, limits, whole=True) if conn.vendor != "postgresql" else nullcontext()
    # Within a transaction of the caller's, the planner settings would outlast the block.
    own = not conn.in_atomic_block
    with outer, transaction.atomic(using=using):
        if conn.vendor != "postgresql":
            yield
            return
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('lock_timeout', %s, true), "
                "set_config('statement_timeout', %s, true), "
                "set_config('idle_in_transaction_session_timeout', %s, true)"
                + (f", {KEY_ORDER_SETTINGS}" if own else ""),
                [str(_ms(limits.lock)), str(_ms(limits.statement)), str(_ms(limits.idle))],
            )
        with in_key_order(using) if own else nullcontext():
            yield


@contextmanager
def session(using: str, limits: Limits, whole: bool = False) -> Iterator[None]:
    """Bound every lock wait of ``using``'s session to ``limits.lock`` within the block.

    The previous values are put back on exit (when the connection still works).
    PostgreSQL: ``lock_timeout``; SQLite: ``PRAGMA busy_timeout``;
    MySQL/MariaDB: ``innodb_lock_wait_timeout`` (whole seconds), and with
    ``whole`` the statement and idle limits too (:func:`mysql_limits`).
    Others: nothing.
    """
    conn = connections[using]
    setting: AbstractContextManager[None]
    if conn.vendor == "postgresql":
        setting = _restored(
            conn,
            "SELECT current_setting('lock_timeout')",
            lambda v: ("SELECT set_config('lock_timeout', %s, false)", [v[0]]),
            [str(_ms(limits.lock))],
        )
    elif conn.vendor == "sqlite":
        setting = _restored(
            conn,
            "PRAGMA busy_timeout",
            lambda v: (f"PRAGMA busy_timeout = {int(v[0])}", []),  # PRAGMA takes no parameters
            [_ms(limits.lock)],
        )
    elif conn.vendor == "mysql":
        names, values = zip(*mysql_limits(conn, limits, whole), strict=True)
        setting = _restored(
            conn,
            "SELECT " + ", ".join(f"@@SESSION.{name}" for name in names),
            # SET takes no parameters for a system variable's value: numbers, written in.
            lambda v: (
                "SET SESSION "
                + ", ".join(f"{n} = {_number(x)}" for n, x in zip(names, v, strict=True)),
                [],
            ),
            values,
        )
    else:
        setting = nullcontext()
    with setting:
        yield


def mysql_limits(conn: Any, limits: Limits, whole: bool) -> list[tuple[str, Any]]:
    """The session variables bounding a MySQL/MariaDB flush, with their values.

    ``innodb_lock_wait_timeout`` (whole seconds); with ``whole`` (the apply
    transaction) also the statement limit, MariaDB's ``max_statement_time``
    (seconds) or MySQL's ``max_execution_time`` (milliseconds, read-only
    SELECTs alone), and the idle limit: MariaDB's ``idle_transaction_timeout``
    ends a session idle inside a transaction, as PostgreSQL's
    ``idle_in_transaction_session_timeout`` does; MySQL has only the
    session's ``wait_timeout`` (idle anywhere), which the flush holds for the
    transaction alone.
    """
    variables: list[tuple[str, Any]] = [
        ("innodb_lock_wait_timeout", max(1, math.ceil(limits.lock)))
    ]
    if whole and conn.mysql_is_mariadb:
        variables += [
            ("max_statement_time", round(limits.statement, 3)),
            ("idle_transaction_timeout", math.ceil(limits.idle)),
        ]
    elif whole:
        variables += [
            ("max_execution_time", _ms(limits.statement)),
            ("wait_timeout", math.ceil(limits.idle)),
        ]
    return variables


#: The statement (and its parameters) that sets a session's settings to the values given.
Writer = Callable[[Sequence[Any]], tuple[str, list[Any]]]


@contextmanager
def _restored(conn: Any, read: str, write: Writer, values: Sequence[Any]) -> Iterator[None]:
    """Set session settings to ``values``, and back to what they were on exit.

    ``read`` returns the settings' current values as one row, in the order
    ``write`` takes them: one statement each way, whatever their number.
    """

    def put(cursor: Any, new: Sequence[Any]) -> None:
        sql, params = write(new)
        cursor.execute(sql, params or None)

    with conn.cursor() as cursor:
        cursor.execute(read)
        before = cursor.fetchone()
        put(cursor, values)
    try:
        yield
    finally:
        try:
            if conn.is_usable() and not conn.needs_rollback:
                with conn.cursor() as cursor:
                    put(cursor, before)
        except DatabaseError as exc:  # the connection broke: it is replaced, setting and all
            logger.debug("could not restore a session setting: %s", exc)


def _number(value: Any) -> str:
    """A number as an SQL literal (a setting read back may be a Decimal or a string)."""
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


#: Sessions of this database waiting on a lock, each with a session blocking it.
BLOCKED_SQL = """
SELECT w.pid, w.application_name, w.state,
       EXTRACT(EPOCH FROM clock_timestamp() - w.query_start), left(w.query, 200),
       b.pid, b.application_name, b.state, host(b.client_addr),
       EXTRACT(EPOCH FROM clock_timestamp() - b.xact_start), left(b.query, 200)
FROM pg_stat_activity AS w
CROSS JOIN LATERAL unnest(pg_blocking_pids(w.pid)) AS blocker(pid)
JOIN pg_stat_activity AS b ON b.pid = blocker.pid
WHERE w.datname = current_database() AND w.wait_event_type = 'Lock'
  AND w.pid <> pg_backend_pid()
ORDER BY w.pid, b.pid
"""


def flush_tables() -> list[str]:
    """Tables a flush writes in its apply transaction: the ledger, the epochs, the counters."""

    tables = {FlushBatch._meta.db_table, BufferEpoch._meta.db_table}
    tables.update(spec.model._meta.db_table for spec in all_specs())
    return sorted(tables)


#: The same on MySQL 8 and MariaDB 10.6+ (their sys schema), with both sessions' whole
#: statements (the view's own are cut to 64 characters) and the table waited on.
BLOCKED_SQL_MYSQL = """
SELECT w.waiting_pid, NULL, 'active', w.wait_age_secs, LEFT(wp.INFO, 200),
       w.blocking_pid, NULL,
       CASE WHEN bp.COMMAND = 'Sleep' THEN 'idle in transaction' ELSE 'active' END,
       SUBSTRING_INDEX(bp.HOST, ':', 1),
       TIMESTAMPDIFF(SECOND, w.blocking_trx_started, NOW()), LEFT(bp.INFO, 200),
       w.locked_table
FROM sys.innodb_lock_waits AS w
LEFT JOIN information_schema.PROCESSLIST AS wp ON wp.ID = w.waiting_pid
LEFT JOIN information_schema.PROCESSLIST AS bp ON bp.ID = w.blocking_pid
WHERE w.waiting_pid <> CONNECTION_ID()
ORDER BY w.waiting_pid, w.blocking_pid
"""


def _waits(conn: Any) -> list[tuple]:
    """Rows of :data:`BLOCKED_SQL` (or its MySQL twin) on this database; [] elsewhere."""
    if conn.vendor == "postgresql":
        sql = BLOCKED_SQL
    elif conn.vendor == "mysql":
        sql = BLOCKED_SQL_MYSQL
    else:
        return []
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql)
            rows = cursor.fetchall()
    except DatabaseError as exc:
        logger.debug("lock waits could not be read: %s", exc)
        return []
    if conn.vendor == "mysql":  # the sys view shows every database: keep this one's
        here = f"`{conn.settings_dict['NAME']}`."
        rows = [row[:11] for row in rows if (row[11] or "").startswith(here)]
    return rows


def blocked_flushes(using: str) -> list[dict[str, Any]]:
    """Flush statements of ``using`` waiting on a lock, and the session holding it.

    A statement counts as a flush's when it writes the ledger, the epochs or a
    counter table. Each entry: ``pid``, ``application``, ``waiting_seconds``,
    ``query`` of the waiting session and ``blocked_by``: ``pid``,
    ``application``, ``state`` (``idle in transaction`` for a frozen client),
    ``client``, ``transaction_seconds``, ``query``. PostgreSQL reads
    ``pg_stat_activity``; MySQL and MariaDB ``sys.innodb_lock_waits`` (no
    application names there). Empty elsewhere, and when they cannot be read
    (logged at DEBUG; MySQL needs the PROCESS privilege).
    """
    conn = connections[using]
    tables = flush_tables()
    blocked: list[dict[str, Any]] = []
    for row in _waits(conn):
        query = row[4] or ""
        if not any(table in query for table in tables):
            continue
        blocked.append(
            {
                "pid": row[0],
                "application": row[1],
                "waiting_seconds": round(float(row[3] or 0.0), 3),
                "query": " ".join(query.split())[:200],
                "blocked_by": {
                    "pid": row[5],
                    "application": row[6],
                    "state": row[7],
                    "client": row[8],
                    "transaction_seconds": round(float(row[9] or 0.0), 3),
                    "query": " ".join((row[10] or "").split())[:200],
                },
            }
        )
    return blocked
