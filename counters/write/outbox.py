"""The outbox of durable mode: the deltas of each transaction, in the DB until Redis has them.

With ``COUNTERS_DURABLE`` on, the commit wrapper (:mod:`counters.write.transactions`,
through the hook of :mod:`counters.write.durable`) writes the deltas of a
transaction to the ``Outbox`` table inside that transaction, right before
the real COMMIT, under the push id its push will use (:func:`write`). After
the COMMIT the writer pushes them and deletes the row (:func:`forget`, one
DELETE by primary key); when Redis fails, the direct write deletes the row in
its own transaction (:func:`counters.write.fallback.write_direct`). So a
committed change is always in exactly one of: the outbox, Redis, the counter
rows. A row its writer left behind is pushed by the flush
(:func:`counters.write.durable.drain_outbox`).

Each row is claimed by deleting it (``DELETE ... RETURNING``, :func:`claim_row`)
in the transaction that pushes it: a writer's direct write deletes it first
or finds it gone, never both count it.

Rows not pushed yet count as buffered for the audit and the rebuild
(:func:`held`), which would otherwise "repair" them before the flush
pushes them. ``get_count`` does not read the outbox: a dead writer's deltas
show after at most ``COUNTERS_OUTBOX_GRACE`` plus one flush interval.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Count, Min
from django.utils import timezone

from counters.base import backends, conf
from counters.buffer.store import PUSH_MARKER_TTL_MS
from counters.models import Outbox

logger = logging.getLogger(__name__)

#: Age (seconds) past which an outbox row is not pushed but repaired from the truth:
#: the push marker's lifetime minus 60 s for clock skew between hosts and a slow flush.
OUTBOX_SAFE_AGE = PUSH_MARKER_TTL_MS / 1000 - 60


def _table() -> str:

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


def claim_row(push_id: str, using: str) -> dict[str, int] | None:
    """Delete outbox row ``push_id`` and return its deltas; None if it is gone.

    Run inside the transaction that then counts the deltas: the row stays
    locked until it commits, and comes back if it rolls back.
    """
    conn = connections[using]
    qn = conn.ops.quote_name
    table, key, deltas = qn(_table()), qn("push_id"), qn("deltas")
    with conn.cursor() as cursor:
        if conn.vendor == "mysql" and not backends.is_mariadb(conn):
            # MySQL has no DELETE … RETURNING: lock the row, read it, delete it.
            cursor.execute(f"SELECT {deltas} FROM {table} WHERE {key} = %s FOR UPDATE", [push_id])
            row = cursor.fetchone()
            if row is not None:
                cursor.execute(f"DELETE FROM {table} WHERE {key} = %s", [push_id])
        else:
            cursor.execute(f"DELETE FROM {table} WHERE {key} = %s RETURNING {deltas}", [push_id])
            row = cursor.fetchone()
    if row is None:
        return None
    value = row[0]
    data = json.loads(value) if isinstance(value, str | bytes) else value
    return {str(member): int(delta) for member, delta in data.items()}


def held(members: Iterable[str], using: str = DEFAULT_DB_ALIAS) -> dict[str, int]:
    """Deltas of ``members`` held in outbox rows (committed, not in Redis yet, or just pushed).

    Reads the whole table: it holds only rows in flight.
    """

    wanted = set(members)
    total: Counter[str] = Counter()
    for deltas in Outbox.objects.using(using).values_list("deltas", flat=True).iterator():
        for member, delta in (deltas or {}).items():
            if member in wanted:
                total[member] += int(delta)
    return {member: delta for member, delta in total.items() if delta}


def stats(using: str = DEFAULT_DB_ALIAS, now: datetime | None = None) -> tuple[int, float]:
    """(rows, age in seconds of the oldest row; 0.0 when empty) of the outbox of ``using``."""

    agg = Outbox.objects.using(using).aggregate(rows=Count("pk"), oldest=Min("created_at"))
    if not agg["rows"]:
        return 0, 0.0
    age = ((now or timezone.now()) - agg["oldest"]).total_seconds()
    return int(agg["rows"]), max(0.0, age)


def summary(using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    """What ``counters_status`` shows of the outbox of ``using``."""
    rows, age = stats(using)
    return {"rows": rows, "oldest_age": round(age, 3), "durable": conf.durable()}
