"""Flush throughput: keys applied per second by the real flush against a raw SQL bound.

The bound executes the same additive UPDATEs the flush issues (one per
distinct delta in each batch the flush moves: per shard, ``COUNTERS_BATCH_SIZE``
keys at a time, one transaction per batch) from SQL built beforehand, on one
DB-API cursor: the database's share of the work with every layer above it
removed. A second, sequential bound takes the keys in key order instead.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from django.db import connection, transaction

import counters
from counters.models import FlushBatch
from notifications.apps import UNREAD_COUNTER

from .errors import BenchError
from .internals import (
    CHUNK,
    Buffer,
    FlushResult,
    batched,
    column,
    conf,
    lanes,
    model_field,
    pushids,
)
from .internals import shard as flusher

#: Deltas of one flush interval: mostly single notifications, some bursts, some reads.
DELTAS = (1, 1, 1, 1, 1, 1, 2, 2, 3, 5, -1, -2)

PUSH_CHUNK = 10_000


class FlushCheckFailed(BenchError):
    """A bench flush did not apply what was pending."""


def random_deltas(keys: list[int], seed: int) -> dict[int, int]:
    rng = random.Random(seed)
    return {key: rng.choice(DELTAS) for key in keys}


def seed_pending(buffer: Buffer, deltas: Mapping[int, int]) -> None:
    """Push ``deltas`` ({user id: delta}) into the buffer, as committed writes would."""
    spec = counters.get_spec(UNREAD_COUNTER)
    items = [(spec.member(key), delta) for key, delta in deltas.items()]
    for chunk in batched(items, PUSH_CHUNK):
        with pushids.pushing() as push_id:
            buffer.push(dict(chunk), push_id)


@contextmanager
def recorded_batch_ids() -> Iterator[list[str]]:
    """The ids of the batches flushes create meanwhile, to delete their ledger rows after."""
    ids: list[str] = []
    original = flusher.new_batch_id

    def record() -> str:
        batch_id = original()
        ids.append(batch_id)
        return batch_id

    flusher.new_batch_id = record
    try:
        yield ids
    finally:
        flusher.new_batch_id = original


def delete_ledger_rows(batch_ids: list[str]) -> None:
    for chunk in batched(batch_ids, 1000):
        FlushBatch.objects.filter(pk__in=chunk).delete()


def real_flush(buffer: Buffer) -> FlushResult:
    """The flush cron and Celery run, on the bench buffer, without pruning the shared ledger."""
    return lanes.flush_buffer(
        buffer,
        batch_size=conf.batch_size(),
        time_budget=3600.0,
        lease_timeout=conf.lease_timeout(),
        retention=None,
    )


def flush_order(deltas: Mapping[int, int], batch_size: int, buffer: Buffer) -> list[list[int]]:
    """The keys of each batch the flush moves: per shard, ``batch_size`` at a time, in
    ``ZPOPMIN`` order (score, then member)."""
    spec = counters.get_spec(UNREAD_COUNTER)
    shards: dict[int, list[tuple[int, str, int]]] = defaultdict(list)
    for key, delta in deltas.items():
        member = spec.member(key)
        shards[buffer.shard_of(member)].append((delta, member, key))
    return [
        [key for _, _, key in chunk]
        for shard in sorted(shards)
        for chunk in batched(sorted(shards[shard]), batch_size)
    ]


def raw_batches(
    deltas: Mapping[int, int], batch_size: int, order: list[list[int]] | None = None
) -> list[list[str]]:
    """The flush's additive UPDATEs as SQL text, one list per batch.

    The batches are ``order`` (lists of keys), else ``batch_size`` keys at a time in key order.
    """
    spec = counters.get_spec(UNREAD_COUNTER)
    qn = connection.ops.quote_name
    table = qn(spec.model._meta.db_table)
    key = qn(column(spec.key_model_field))
    value = qn(column(model_field(spec.model, spec.value_field)))
    batches = []
    if order is None:
        order = [list(chunk) for chunk in batched(list(deltas), batch_size)]
    for keys in order:
        batch = [(k, deltas[k]) for k in keys]
        by_delta: dict[int, list[int]] = defaultdict(list)
        for k, d in batch:
            by_delta[d].append(int(k))
        batches.append(
            [
                f"UPDATE {table} SET {value} = {value} + {d} "
                f"WHERE {key} IN ({', '.join(map(str, chunk))})"
                for d, keys in sorted(by_delta.items())
                for chunk in batched(keys, CHUNK)
            ]
        )
    return batches


def raw_apply(batches: list[list[str]]) -> float:
    """Execute the prepared batches, one transaction each; seconds taken."""
    connection.ensure_connection()
    cursor = connection.connection.cursor()
    try:
        started = time.perf_counter()
        for statements in batches:
            with transaction.atomic():
                for sql in statements:
                    cursor.execute(sql)
        return time.perf_counter() - started
    finally:
        cursor.close()


def timed_flush(buffer: Buffer, deltas: Mapping[int, int]) -> float:
    seed_pending(buffer, deltas)
    started = time.perf_counter()
    result = real_flush(buffer)
    seconds = time.perf_counter() - started
    if result.keys != len(deltas) or result.dropped or result.busy_shards:
        raise FlushCheckFailed(f"flush applied {result.summary()}, expected {len(deltas)} keys")
    return seconds


def measure(buffer: Buffer, keys: list[int], rounds: int) -> dict:
    """Median keys/s of the real flush and of two raw bounds, rotating which goes first.

    The raw bound runs the UPDATEs of the batches the flush moves (per shard);
    the sequential bound, published before, the same number of keys per batch
    in key order, so each batch touches few table pages (the flush's batches
    touch keys spread over the whole table).
    """
    deltas = random_deltas(keys, seed=len(keys))
    size = conf.batch_size()
    batches = raw_batches(deltas, size, flush_order(deltas, size, buffer))
    sequential = raw_batches(deltas, size)
    times: dict[str, list[float]] = {"flush": [], "raw": [], "sequential": []}
    runs = {
        "flush": lambda: timed_flush(buffer, deltas),
        "raw": lambda: raw_apply(batches),
        "sequential": lambda: raw_apply(sequential),
    }
    names = list(runs)
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            times[name].append(runs[name]())
    rate = {name: len(keys) / statistics.median(values) for name, values in times.items()}
    return {
        "keys": len(keys),
        "batch_size": size,
        "batches": len(batches),
        "statements": sum(len(b) for b in batches),
        "flush_keys_per_s": round(rate["flush"], 1),
        "raw_keys_per_s": round(rate["raw"], 1),
        "raw_sequential_keys_per_s": round(rate["sequential"], 1),
        "flush_raw": round(rate["flush"] / rate["raw"], 3),
        "flush_raw_sequential": round(rate["flush"] / rate["sequential"], 3),
        "rounds": {
            "flush_s": [round(s, 3) for s in times["flush"]],
            "raw_s": [round(s, 3) for s in times["raw"]],
            "raw_sequential_s": [round(s, 3) for s in times["sequential"]],
        },
    }
