"""The read path: a counter's exact value is its row plus what is still buffered.

Buffered is pending, in flight (unless its batch is in the ledger) and
quarantined: a quarantined delta is a committed change that could not be
applied yet, part of the value until it is retried (and applied) or
discarded. The audit and the rebuild compare this same value with the
truth, so they never "repair" a quarantined delta that a retry then
applies a second time.

One reading takes a Redis snapshot of the members (pending, in flight, the
batch id in flight, the shard's generation), then one DB statement (the rows,
which in-flight batch ids the ledger has, and the direct writes whose Redis
push may still arrive), then the generations again. A batch moved and applied
between the two Redis reads would be counted twice, so such a reading is
taken again; after a few tries the shards' leases are taken, so no flusher
can move anything while the read runs. A read never returns a number it
could not prove consistent: :class:`InconsistentRead` is raised instead.

Inside a transaction the deltas it has recorded but not yet sent are added,
so a request sees its own changes.

From async code, :func:`aget_value` and :func:`aget_values` run that same
read in a thread, the way Django's async ORM methods run their queries
(``sync_to_async``, thread-sensitive): it keeps every guarantee above,
including the deltas of a transaction that the calling thread holds open.
A native asyncio Redis client was measured against it and lost: the read
still needs its database statement in a thread, so it only added a second
client and its overhead (docs/benchmarks.md, "Async reads").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections
from redis import RedisError

from counters.base import conf
from counters.base.exceptions import BufferUnavailable, InconsistentRead
from counters.base.registry import CounterSpec, get_spec
from counters.base.utils import column, model_field
from counters.buffer.lease import Lease
from counters.buffer.pushids import PushId
from counters.buffer.store import Buffer, Snapshot
from counters.client import get_buffer
from counters.models import FALLBACK_PREFIX, FlushBatch, Tombstone
from counters.read import backfill
from counters.write import acks, natural_keys, sender, transactions
from counters.write import negatives as repair
from counters.write.sender import Sender

logger = logging.getLogger(__name__)

#: Optimistic readings before a read takes the shards' leases.
OPTIMISTIC_READINGS = 5
#: Seconds a read waits for the leases of its shards (a flush batch holds one briefly).
LEASE_WAIT = 5.0


@dataclass(frozen=True)
class _Rows:
    stored: dict[Any, int]
    applied: set[str]
    unsettled: dict[str, dict[str, int]]  # push id -> {member: delta} of direct writes


def get_values(name: str, keys: Iterable[Any], *, using: str = DEFAULT_DB_ALIAS) -> dict[Any, int]:
    """Exact current values: stored row + pending + in-flight unless already applied + quarantined.

    If Redis is unreachable the stored rows are returned: changes made while
    Redis is down are written to the rows directly, so they are the best answer
    there is, and a page must not fail because of the buffer. A counter
    registered ``non_negative`` never reads below 0 (see :mod:`counters.write.negatives`).

    A counter still backfilling (new over existing rows, :mod:`counters.read.backfill`)
    reads its truth instead: its stored values do not count the older rows yet.
    """
    spec = get_spec(name)
    if backfill.is_backfilling(spec, using):
        return backfill.truth_values(spec, keys, using)
    values = _exact_values(name, keys, using)
    return repair.clamp(spec, values, lambda: get_buffer(using))


def _exact_values(name: str, keys: Iterable[Any], using: str) -> dict[Any, int]:
    keys = list(dict.fromkeys(keys))
    try:
        parts = get_parts(name, keys, using=using)
    except BufferUnavailable as exc:
        logger.warning("%s; reading %s from the DB only", exc, name)
        spec = get_spec(name)
        normal = {key: spec.normalize(key) for key in keys}
        stored = _read_rows(spec, list(dict.fromkeys(normal.values())), set(), using).stored
        members = [spec.member(v) for v in normal.values()]
        own = transactions.unsent(members, using)
        with sender.holding(using) as queue:  # the DB directly once the sender fails too
            _add_queued(own, members, queue)
        return {
            key: stored.get(value, 0) + own.get(spec.member(value), 0)
            for key, value in normal.items()
        }
    return {key: stored + buffered for key, (stored, buffered) in parts.items()}


def get_value(name: str, key: Any, *, using: str = DEFAULT_DB_ALIAS) -> int:
    return get_values(name, [key], using=using)[key]


async def aget_values(name: str, keys: Iterable[Any], using: str | None = None) -> dict[Any, int]:
    """:func:`get_values` from async code: the same exact values, read in a thread.

    ``keys`` is consumed in that thread, so it may be a lazy QuerySet
    (``values_list("pk", flat=True)``). ``using=None`` is the default database.
    """
    return await sync_to_async(get_values)(name, keys, using=using or DEFAULT_DB_ALIAS)


async def aget_value(name: str, key: Any, using: str | None = None) -> int:
    """:func:`get_value` from async code: the same exact value, read in a thread."""
    return (await aget_values(name, [key], using))[key]


def _add_queued(own: dict[str, int], members: Iterable[str], queue: Sender | None) -> None:
    """Add to ``own`` what this process's sender still queues of ``members`` (held still)."""
    if queue is not None:
        for member, delta in queue.queued(members).items():
            own[member] = own.get(member, 0) + delta


def get_parts(
    name: str, keys: Iterable[Any], *, using: str = DEFAULT_DB_ALIAS
) -> dict[Any, tuple[int, int]]:
    """(stored, buffered) per key; their sum is the exact value.

    ``buffered`` includes the deltas of the current transaction not yet sent.
    Raises :class:`BufferUnavailable` when Redis cannot be reached and
    :class:`InconsistentRead` when no consistent reading could be taken.
    """
    spec = get_spec(name)
    keys = list(dict.fromkeys(keys))
    if not keys:
        return {}
    # Keys are normalised ("7" and 7 read one counter); the result keeps the caller's keys.
    normal = {key: spec.normalize(key) for key in keys}
    members = {spec.member(value): value for value in normal.values()}
    buffer = get_buffer(using)
    own = transactions.unsent(members, using)
    with sender.holding(using) as queue:
        acks.acknowledge(using)  # what this process pushed has applied, or was completed
        try:
            snap, rows = _consistent_reading(buffer, spec, members, using)
        except RedisError as exc:
            raise BufferUnavailable(conf.redis_where(), exc) from exc
        _add_queued(own, members, queue)
    twice = _counted_twice(buffer, snap, rows)
    parts = {}
    for key, value in normal.items():
        member = spec.member(value)
        shard = buffer.shard_of(member)
        inflight = 0 if snap.inflight_ids.get(shard) in rows.applied else snap.inflight[member]
        buffered = (
            snap.pending[member]
            + inflight
            + snap.quarantined[member]
            + own.get(member, 0)
            - twice.get(member, 0)
        )
        parts[key] = (rows.stored.get(value, 0), buffered)
    return parts


def _consistent_reading(
    buffer: Buffer, spec: CounterSpec, members: dict[str, Any], using: str
) -> tuple[Snapshot, _Rows]:
    push_ids: set[str] = set()
    for _ in range(OPTIMISTIC_READINGS):
        reading = _reading(buffer, spec, members, using, push_ids)
        if reading is not None:
            return reading
    return _patient_reading(buffer, spec, members, using, push_ids)


def _reading(
    buffer: Buffer, spec: CounterSpec, members: dict[str, Any], using: str, push_ids: set[str]
) -> tuple[Snapshot, _Rows] | None:
    """One reading, or None if it cannot be trusted (``push_ids`` grows as needed)."""
    snap = buffer.snapshot(members, push_ids=sorted(push_ids))
    rows = _read_rows(spec, list(members.values()), set(snap.inflight_ids.values()), using)
    relevant = {p for p, deltas in rows.unsettled.items() if not members.keys().isdisjoint(deltas)}
    if not relevant <= push_ids:
        push_ids.update(relevant)  # read their writers' marks in the same snapshot next time
        return None
    if buffer.generations(snap.gens) != snap.gens:
        return None
    return snap, rows


def _patient_reading(
    buffer: Buffer, spec: CounterSpec, members: dict[str, Any], using: str, push_ids: set[str]
) -> tuple[Snapshot, _Rows]:
    """Readings until one holds, taking the shards' leases as soon as they are free.

    Under the leases no flusher moves or acknowledges a batch, so a reading
    holds unless a flusher outlived its lease. Gives up after ``LEASE_WAIT``.
    """
    shards = sorted(buffer.by_shard(members))
    ttl = conf.lease_timeout()
    deadline = time.monotonic() + LEASE_WAIT
    pause = 0.001
    while True:
        leases = [Lease(buffer.client, buffer.key(s, "lease"), ttl) for s in shards]
        try:
            # In shard order, and all or nothing: two such reads never wait on each other.
            if all(lease.acquire() for lease in leases):
                for _ in range(OPTIMISTIC_READINGS):
                    reading = _reading(buffer, spec, members, using, push_ids)
                    if reading is not None:
                        return reading
            else:
                reading = _reading(buffer, spec, members, using, push_ids)
                if reading is not None:
                    return reading
        finally:
            for lease in leases:
                if lease.held:
                    lease.release()
        if time.monotonic() >= deadline:
            raise InconsistentRead(spec.name, shards)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _counted_twice(buffer: Buffer, snap: Snapshot, rows: _Rows) -> dict[str, int]:
    """Deltas both written to the DB directly and delivered late by their push.

    A direct write whose push timed out stays unsettled until a flush fences
    the push. If the push did reach Redis meanwhile (its writer's high-water
    mark reached it: the writer was retired with it, so it is the writer's
    last push, and no take-back push has run), the same deltas are in a row
    and in the buffer: they are counted once here, before the flush takes
    them back.
    """
    twice: dict[str, int] = {}
    for push_id, deltas in rows.unsettled.items():
        pid = PushId.of(push_id)
        for member, delta in deltas.items():
            if member not in snap.pending:
                continue
            shard = buffer.shard_of(member)
            if snap.applied(shard, pid) and not snap.applied(shard, pid.undo()):
                twice[member] = twice.get(member, 0) + delta
    return twice


def _read_rows(spec: CounterSpec, keys: list, batch_ids: set[str], using: str) -> _Rows:
    """Stored values of ``keys``, which of ``batch_ids`` are applied, and unsettled
    direct writes, in one statement: one statement sees one snapshot, so they agree."""

    model = spec.model
    conn = connections[using]
    qn = conn.ops.quote_name
    table = qn(model._meta.db_table)
    key_fields = spec.codec.fields if spec.codec is not None else (spec.key_model_field,)
    key_cols = [qn(column(f)) for f in key_fields]
    nulls = "NULL, " * len(key_cols)
    value_col = qn(column(model_field(model, spec.value_field)))
    ledger = qn(FlushBatch._meta.db_table)
    ledger_pk = qn(column(model_field(FlushBatch, "pk")))
    unsettled_col = qn(column(model_field(FlushBatch, "unsettled")))
    kind_col = qn(column(model_field(FlushBatch, "kind")))
    ids = sorted(batch_ids)
    sql = f"SELECT {', '.join(key_cols)}, {value_col}, NULL, NULL FROM {table} WHERE "
    params: list = []
    if spec.codec is None:
        sql += f"{key_cols[0]} IN ({', '.join(['%s'] * len(keys))})"
        params += [spec.key_model_field.get_db_prep_value(k, conn) for k in keys]
    else:  # a composite key: one (a = %s AND b = %s) per key
        one = "(" + " AND ".join(f"{c} = %s" for c in key_cols) + ")"
        sql += " OR ".join([one] * len(keys))
        params += [p for k in keys for p in spec.codec.db_values(k, conn)]
    if ids:
        sql += (
            f" UNION ALL SELECT {nulls}NULL, {ledger_pk}, NULL FROM {ledger} "
            f"WHERE {ledger_pk} IN ({', '.join(['%s'] * len(ids))})"
        )
        params += ids
    tombs = _tombstones(spec, keys, nulls, conn)  # a natural key's: row + tombstone + buffer
    sql += tombs[0]
    params += tombs[1]
    # The JSON as text on every backend (MySQL casts to CHAR, not TEXT). Only direct writes
    # are unsettled: the kind lets MySQL, which has no partial index, use counters_fallback.
    text = "CHAR" if conn.vendor == "mysql" else "TEXT"
    sql += (
        f" UNION ALL SELECT {nulls}NULL, {ledger_pk}, CAST({unsettled_col} AS {text}) "
        f"FROM {ledger} WHERE {kind_col} = %s AND {unsettled_col} IS NOT NULL"
    )
    params.append(FlushBatch.Kind.FALLBACK.value)
    rows = _Rows({}, set(), {})
    width = len(key_cols)
    texts = {str(key): key for key in keys}
    with conn.cursor() as cursor:
        cursor.execute(sql, params)
        for row in cursor.fetchall():
            value, batch_id, unsettled = row[width:]
            if unsettled == TOMBSTONE:  # batch_id holds the key as text
                key = texts[batch_id]
                rows.stored[key] = rows.stored.get(key, 0) + int(value)
            elif batch_id is None:
                key = row[0] if width == 1 else tuple(row[:width])
                rows.stored[spec.to_key(key)] = int(value)
            elif unsettled is None:
                rows.applied.add(batch_id)
            else:
                deltas = json.loads(unsettled) if isinstance(unsettled, str) else unsettled
                rows.unsettled[batch_id.removeprefix(FALLBACK_PREFIX)] = deltas
    return rows


#: The marker of a tombstone's line in :func:`_read_rows`.
TOMBSTONE = "tombstone"


def _tombstones(spec: CounterSpec, keys: list, nulls: str, conn: Any) -> tuple[str, list]:
    """The part of :func:`_read_rows`' statement reading the tombstones of ``keys``.

    A counter keyed by a natural key: while its parent is deleted, or back
    by a route that does not take its tombstone (``bulk_create()``,
    ``update()``, a rename), the tombstone is part of the value until a
    flush folds it into the row (:mod:`counters.write.natural_keys`).
    """
    if spec.codec is not None or not natural_keys.reusable(spec) or not keys:
        return "", []
    qn = conn.ops.quote_name
    table = qn(Tombstone._meta.db_table)
    sql = (
        f" UNION ALL SELECT {nulls}{qn('value')}, {qn('key')}, %s FROM {table} "
        f"WHERE counter = %s AND {qn('key')} IN ({', '.join(['%s'] * len(keys))})"
    )
    return sql, [TOMBSTONE, spec.name, *(str(key) for key in keys)]
