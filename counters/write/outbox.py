"""The outbox of durable mode: the deltas of each transaction, in the DB until Redis has them.

With ``COUNTERS_DURABLE`` on, the commit wrapper (:mod:`counters.write.transactions`,
through the hook of :mod:`counters.write.durable`) writes the deltas of a
transaction to the ``Outbox`` table inside that transaction, right before
the real COMMIT, under the push id its push will use (:func:`write`): the one
statement durable mode adds to a transaction. After the COMMIT the writer
pushes them and is done; the next flush deletes the rows whose push applied
in Redis, many in one DELETE (:func:`clear_landed`). When Redis fails, the
direct write deletes the row in its own transaction
(:func:`counters.write.fallback.write_direct`). So a committed change is
always in the outbox, in Redis, or in the counter rows, and a row whose push
applied is never pushed or written again. A row its writer left behind is
pushed by the flush (:func:`counters.write.durable.drain_outbox`).

Each row is claimed by deleting it (``DELETE ... RETURNING``, :func:`claim_row`)
in the transaction that pushes or writes it: a writer's direct write deletes
it first or finds it gone, never both count it.

Rows whose push has not applied count as buffered for the audit and the
rebuild (:func:`held`), which would otherwise "repair" them before the flush
pushes them. ``get_count`` does not read the outbox: a dead writer's deltas
show after at most ``COUNTERS_OUTBOX_GRACE`` plus one flush interval.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Count, Min, Q
from django.utils import timezone

from counters.base import backends, conf
from counters.buffer.store import PUSH_MARKER_TTL_MS, Buffer
from counters.client import get_buffer
from counters.models import Outbox

logger = logging.getLogger(__name__)

#: Age (seconds) past which an outbox row is not pushed but repaired from the truth:
#: the push marker's lifetime minus 60 s for clock skew between hosts and a slow flush.
OUTBOX_SAFE_AGE = PUSH_MARKER_TTL_MS / 1000 - 60


def _table() -> str:

    return Outbox._meta.db_table


#: The INSERT of :func:`write` per (database vendor, table): a durable write makes one per
#: change.
_inserts: dict[tuple[str, str], str] = {}


def write(deltas: Mapping[str, int], using: str, push_id: str) -> None:
    """Insert the outbox row of ``deltas`` under ``push_id`` on the current transaction."""
    conn = connections[using]
    table = _table()
    sql = _inserts.get((conn.vendor, table))
    if sql is None:
        qn = conn.ops.quote_name
        sql = _inserts[(conn.vendor, table)] = (
            f"INSERT INTO {qn(table)} ({qn('push_id')}, {qn('deltas')}, {qn('created_at')}) "
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


def update(push_id: str, deltas: Mapping[str, int], using: str) -> bool:
    """Replace the deltas of outbox row ``push_id`` (the members a writer wrote directly
    are gone from it), on the current transaction; False if the row is gone."""
    conn = connections[using]
    qn = conn.ops.quote_name
    sql = f"UPDATE {qn(_table())} SET {qn('deltas')} = %s WHERE {qn('push_id')} = %s"
    with conn.cursor() as cursor:
        cursor.execute(sql, [json.dumps(dict(deltas)), push_id])
        return cursor.rowcount > 0


def clear_landed(buffer: Buffer, using: str = DEFAULT_DB_ALIAS, limit: int = 1000) -> int:
    """Delete the outbox rows whose push has applied in Redis, oldest first; how many.

    The flush's bulk DELETE that ends what a writer's push began: the writer
    never deletes its row after a push (:mod:`counters.write.delivery`). A
    row whose push applied in every shard of its members (its writer's
    high-water mark there, :meth:`counters.buffer.intake.Intake.landed`) is
    counted in Redis, so it goes. One that did not, or not yet, stays: its
    writer may still push it, or write it directly (deleting it then), and
    past the grace a flush pushes it (:func:`counters.write.durable.drain_outbox`).

    Reads ``limit`` rows at a time (one Redis round trip and one DELETE
    each) until it has seen every row.
    """
    table = Outbox.objects.using(using).order_by("created_at", "push_id")
    deleted = 0
    after: tuple[datetime, str] | None = None
    while True:
        page = table
        if after is not None:
            page = page.filter(
                Q(created_at__gt=after[0]) | Q(created_at=after[0], push_id__gt=after[1])
            )
        rows = list(page.values_list("push_id", "deltas", "created_at")[:limit])
        if not rows:
            return deleted
        pushed = [[m for m, delta in (deltas or {}).items() if delta] for _, deltas, _ in rows]
        landed = buffer.landed(
            [(members, push_id) for members, (push_id, _, _) in zip(pushed, rows, strict=True)]
        )
        done = [
            push_id
            for (push_id, _, _), members, applied in zip(rows, pushed, landed, strict=True)
            if len(applied) == len(members)
        ]
        if done:
            deleted += Outbox.objects.using(using).filter(push_id__in=done).delete()[0]
        if len(rows) < limit:
            return deleted
        after = (rows[-1][2], rows[-1][0])


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


@dataclass
class Held:
    """What outbox rows hold of some members (:func:`held`)."""

    #: member -> sum of its deltas in rows whose push has not applied in Redis.
    deltas: dict[str, int] = field(default_factory=dict)
    #: Members of rows older than :data:`OUTBOX_SAFE_AGE` whose push does not show as
    #: applied: Redis may have forgotten it; the next flush repairs them from the truth.
    unknown: set[str] = field(default_factory=set)


def held(members: Iterable[str], using: str = DEFAULT_DB_ALIAS) -> Held:
    """Deltas of ``members`` held in outbox rows and not in Redis (committed, not pushed yet).

    A row stays after its push until a flush deletes it (:func:`clear_landed`):
    a member whose shard applied the row's push is counted in Redis, so it is
    left out here.
    Reads the whole table: it holds only rows in flight.
    """
    wanted = set(members)
    rows = [
        (push_id, deltas, created)
        for push_id, deltas, created in Outbox.objects.using(using)
        .values_list("push_id", "deltas", "created_at")
        .iterator()
        if wanted.intersection(deltas or ())
    ]
    result = Held()
    if not rows:
        return result
    landed = get_buffer(using).landed([(deltas, push_id) for push_id, deltas, _ in rows])
    now = timezone.now()
    total: Counter[str] = Counter()
    for (_, deltas, created), applied in zip(rows, landed, strict=True):
        members = wanted.intersection(deltas).difference(applied)
        if (now - created).total_seconds() > OUTBOX_SAFE_AGE:
            result.unknown.update(members)
            continue
        for member in members:
            total[member] += int(deltas[member])
    result.deltas = {member: delta for member, delta in total.items() if delta}
    return result


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
