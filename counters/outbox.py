"""Durable mode: the deltas of each transaction, kept in the database until Redis has them.

With ``COUNTERS_DURABLE`` on, the commit wrapper (:mod:`counters.transactions`)
writes the deltas of a transaction to the ``Outbox`` table inside that
transaction, right before the real COMMIT, under the push id its push will
use. After the COMMIT the writer pushes them and deletes the row (one DELETE
by primary key); when Redis fails, the direct write deletes the row in its own
transaction (:func:`counters.writes.write_direct`). So a committed change is
always in exactly one of: the outbox, Redis, the counter rows.

A writer that dies between COMMIT and that DELETE (SIGKILL, OOM, a lost
host) leaves its row behind. Each flush runs :func:`drain` before it moves
batches: a row older than ``COUNTERS_OUTBOX_GRACE`` is pushed with its stored
push id and deleted. Redis remembers a push id for ``PUSH_MARKER_TTL_MS``
(180 s), so a push that did land before the writer died is not counted twice.
A row older than :data:`OUTBOX_SAFE_AGE` (120 s: the TTL minus a margin for
clock skew and slow flushes) can no longer be pushed safely: its members are
queued for repair from the truth (``<prefix>:repair``, rebuilt by the same
flush) and the row is deleted.

Each row is claimed by deleting it (``DELETE ... RETURNING``) in the
transaction that pushes it: a writer's direct write deletes it first or finds
it gone, never both count it.

Rows not pushed yet count as buffered for the audit and the rebuild
(:func:`pending`), which would otherwise "repair" them before the flush
pushes them. ``get_count`` does not read the outbox: a dead writer's deltas
show after at most ``COUNTERS_OUTBOX_GRACE`` plus one flush interval.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from . import conf
from .buffer import PUSH_MARKER_TTL_MS, Buffer
from .exceptions import StalePush

logger = logging.getLogger(__name__)

#: Age (seconds) past which an outbox row is not pushed but repaired from the truth:
#: the push marker's lifetime minus 60 s for clock skew between hosts and a slow flush.
OUTBOX_SAFE_AGE = PUSH_MARKER_TTL_MS / 1000 - 60
#: Most rows one flush handles per database.
DRAIN_LIMIT = 1000


def _table() -> str:
    from .models import Outbox

    return Outbox._meta.db_table


def write(deltas: Mapping[str, int], using: str, push_id: str) -> None:
    """Insert the outbox row of ``deltas`` under ``push_id`` on the current transaction."""
    conn = connections[using]
    qn = conn.ops.quote_name
    sql = (
        f"INSERT INTO {qn(_table())} ({qn('push_id')}, {qn('deltas')}, {qn('created_at')}) "
        "VALUES (%s, %s, %s)"
    )
    created = conn.ops.adapt_datetimefield_value(timezone.now())
    with conn.cursor() as cursor:
        cursor.execute(sql, [push_id, json.dumps(dict(deltas)), created])


def delete(push_id: str, using: str) -> bool:
    """Delete outbox row ``push_id``; False if there was none (another process took it).

    Right after the COMMIT of ``atomic()`` or of a manual transaction
    (autocommit still off), the DELETE is committed here, as a transaction of
    its own.
    """
    conn = connections[using]
    qn = conn.ops.quote_name
    manual = not conn.in_atomic_block and not conn.get_autocommit()
    sql = f"DELETE FROM {qn(_table())} WHERE {qn('push_id')} = %s"
    return _execute(conn, sql, [push_id], commit=manual) > 0


def forget(push_id: str, using: str) -> None:
    """Delete outbox row ``push_id`` once Redis acknowledged its push: the writer's last step.

    Outside a transaction (right after a COMMIT), on PostgreSQL the DELETE
    commits without waiting for its WAL flush (``synchronous_commit`` off for
    it alone, one round trip): a DELETE lost by a database crash only leaves
    the row for a flush to push again under the same push id, which Redis
    ignores (or, past :data:`OUTBOX_SAFE_AGE`, for a repair from the truth).
    That saves a second fsync per transaction.
    """
    conn = connections[using]
    server_side = conn.settings_dict.get("OPTIONS", {}).get("server_side_binding")
    if conn.vendor != "postgresql" or conn.in_atomic_block or server_side:
        delete(push_id, using)  # (server-side binding prepares one statement at a time)
        return
    qn = conn.ops.quote_name
    sql = (
        "SET LOCAL synchronous_commit TO OFF; "
        f"DELETE FROM {qn(_table())} WHERE {qn('push_id')} = %s"
    )
    # With autocommit on, both statements run in one implicit transaction.
    _execute(conn, sql, [push_id], commit=not conn.get_autocommit())


def _execute(conn: BaseDatabaseWrapper, sql: str, params: list, commit: bool) -> int:
    """Run ``sql``; with ``commit`` (autocommit off, no atomic block) commit it here, or roll
    it back if it fails. Returns the cursor's row count."""
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            count = cursor.rowcount
        if commit:
            conn.commit()
    except Exception:
        if commit:
            conn.rollback()
        raise
    return count


def claim(push_id: str, using: str) -> dict[str, int] | None:
    """Delete outbox row ``push_id`` and return its deltas; None if it is gone.

    Run inside the transaction that then counts the deltas: the row stays
    locked until it commits, and comes back if it rolls back.
    """
    conn = connections[using]
    qn = conn.ops.quote_name
    with conn.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {qn(_table())} WHERE {qn('push_id')} = %s RETURNING {qn('deltas')}",
            [push_id],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    value = row[0]
    data = json.loads(value) if isinstance(value, str | bytes) else value
    return {str(member): int(delta) for member, delta in data.items()}


def pending(members: Iterable[str], using: str = DEFAULT_DB_ALIAS) -> dict[str, int]:
    """Deltas of ``members`` held in outbox rows (committed, not in Redis yet, or just pushed).

    Reads the whole table: it holds only rows in flight.
    """
    from .models import Outbox

    wanted = set(members)
    total: Counter[str] = Counter()
    for deltas in Outbox.objects.using(using).values_list("deltas", flat=True).iterator():
        for member, delta in (deltas or {}).items():
            if member in wanted:
                total[member] += int(delta)
    return {member: delta for member, delta in total.items() if delta}


def stats(using: str = DEFAULT_DB_ALIAS, now: datetime | None = None) -> tuple[int, float]:
    """(rows, age in seconds of the oldest row; 0.0 when empty) of the outbox of ``using``."""
    from django.db.models import Count, Min

    from .models import Outbox

    agg = Outbox.objects.using(using).aggregate(rows=Count("pk"), oldest=Min("created_at"))
    if not agg["rows"]:
        return 0, 0.0
    age = ((now or timezone.now()) - agg["oldest"]).total_seconds()
    return int(agg["rows"]), max(0.0, age)


#: Outcomes of :func:`push_row`.
GONE, PUSHED, DIRECT, REPAIR = "gone", "pushed", "direct", "repair"


def push_row(buffer: Buffer, using: str, push_id: str, age: Callable[[], timedelta]) -> str:
    """Claim outbox row ``push_id`` and push it under its id, in one DB transaction.

    Returns ``GONE`` (another process took it), ``PUSHED``, ``DIRECT`` (pushed,
    and the members Redis cannot sum exactly written to the DB) or ``REPAIR``
    (too old to push safely, ``age()`` past :data:`OUTBOX_SAFE_AGE`, or
    refused as stale: its members are queued for repair from the truth).
    Raises ``RedisError`` when Redis fails: the transaction rolls back and
    the row stays.

    A push made here carries the time of this call: Redis's 30 s limit on a
    push's age is about late network deliveries of an old push, and the push
    id's marker (180 s) is what keeps this push from counting what the
    writer's own push, if it landed, already counted.
    """
    from . import repair
    from .writes import push_exact, write_direct

    with transaction.atomic(using=using):
        deltas = claim(push_id, using)
        if deltas is None:
            return GONE  # its writer deleted it meanwhile (pushed, or wrote it directly)
        seconds = age().total_seconds()
        reason, direct = "", dict[str, int]()
        if seconds > OUTBOX_SAFE_AGE:
            reason = f"{seconds:.0f}s old, beyond the {OUTBOX_SAFE_AGE:.0f}s a push id is safe"
        else:
            rest = dict(deltas)
            try:
                push_exact(buffer, rest, direct, push_id)
            except StalePush:
                reason = "refused by Redis as a stale push"
        if reason:
            if deltas:
                buffer.client.sadd(repair.queue_key(buffer), *sorted(deltas))
            logger.warning(
                "outbox row %s (%s deltas) not pushed: %s; its keys are queued for repair "
                "from the truth",
                push_id,
                len(deltas),
                reason,
            )
            return REPAIR
        if direct:
            write_direct(direct, using)
            return DIRECT
        return PUSHED


@dataclass
class DrainResult:
    pushed: int = 0  # rows pushed by the flush (their writer died or could not push)
    repaired: int = 0  # rows too old to push: their members were queued for repair
    direct: int = 0  # rows (partly) written to the DB (a sum Redis cannot hold exactly)

    def summary(self) -> str:
        return f"outbox: {self.pushed} rows pushed, {self.repaired} too old queued for repair" + (
            f", {self.direct} written to the DB" if self.direct else ""
        )


def drain(
    buffer: Buffer,
    using: str = DEFAULT_DB_ALIAS,
    *,
    grace: float | None = None,
    limit: int = DRAIN_LIMIT,
) -> DrainResult:
    """Push the outbox rows older than ``grace`` seconds, each exactly once; delete them.

    Runs in the flush before it moves batches. A row too old for Redis to
    still remember its push id (:data:`OUTBOX_SAFE_AGE`), or refused as a
    stale push, is not pushed: its members go to the repair queue, which the
    same flush rebuilds from the truth. Raises ``RedisError`` when Redis
    fails: the row being pushed stays (its transaction rolls back) for the
    next flush.
    """
    from . import metrics
    from .models import Outbox

    grace = conf.outbox_grace() if grace is None else grace
    result = DrainResult()
    cutoff = timezone.now() - timedelta(seconds=grace)
    due = list(
        Outbox.objects.using(using)
        .filter(created_at__lte=cutoff)
        .order_by("created_at")
        .values_list("push_id", "created_at")[:limit]
    )
    for push_id, created_at in due:
        outcome = push_row(buffer, using, push_id, _age_since(created_at))
        if outcome == PUSHED:
            result.pushed += 1
        elif outcome == REPAIR:
            result.repaired += 1
        elif outcome == DIRECT:
            result.pushed += 1
            result.direct += 1
    if result.pushed or result.repaired:
        logger.info("%s (database %r)", result.summary(), using)
    metrics.outbox_drained(using, result.pushed, result.repaired)
    return result


def summary(using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    """What ``counters_status`` shows of the outbox of ``using``."""
    rows, age = stats(using)
    return {"rows": rows, "oldest_age": round(age, 3), "durable": conf.durable()}


def _age_since(created_at: datetime) -> Callable[[], timedelta]:
    return lambda: timezone.now() - created_at


def push_late(push_id: str, using: str, seconds: float) -> None:
    """A writer's push ``seconds`` after its outbox row, past ``COUNTERS_OUTBOX_GRACE``.

    A flush may have pushed the row already, long enough ago for Redis to
    forget the push id: the writer claims its row first, like a flush, and
    pushes only if it is still there. Never raises (it runs after COMMIT): a
    row it could not push stays for the flush.
    """
    from .client import get_buffer

    started = timezone.now() - timedelta(seconds=seconds)
    conn = connections[using]
    # Right after the COMMIT of atomic() or of a manual transaction, autocommit is still
    # off: atomic() then does not commit by itself, so this is committed here.
    manual = not conn.in_atomic_block and not conn.get_autocommit()
    try:
        push_row(get_buffer(using), using, push_id, _age_since(started))
        if manual:
            conn.commit()
    except Exception as exc:
        if manual:
            conn.rollback()
        logger.warning("outbox row %s left for the flush to push: %s", push_id, exc)
