"""Flush throughput: keys applied per second by the real flush against a raw SQL bound.

The bound executes the same additive UPDATEs the flush issues (one per
distinct delta in each batch of ``COUNTERS_BATCH_SIZE`` keys, one transaction
per batch) from SQL built beforehand, on one DB-API cursor: the database's
share of the work with every layer above it removed.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from django.db import connection, transaction

from counters import conf, flusher, writers
from counters.apply import CHUNK
from counters.buffer import Buffer
from counters.models import FlushBatch
from counters.registry import get_spec
from counters.utils import batched, column, model_field
from notifications.apps import UNREAD_COUNTER

from .errors import BenchError

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
    spec = get_spec(UNREAD_COUNTER)
    items = [(spec.member(key), delta) for key, delta in deltas.items()]
    for chunk in batched(items, PUSH_CHUNK):
        with writers.pushing() as push_id:
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


def real_flush(buffer: Buffer) -> flusher.FlushResult:
    """The flush cron and Celery run, on the bench buffer, without pruning the shared ledger."""
    return flusher.flush(
        buffer,
        batch_size=conf.batch_size(),
        time_budget=3600.0,
        lease_timeout=conf.lease_timeout(),
        retention=None,
    )


def raw_batches(deltas: Mapping[int, int], batch_size: int) -> list[list[str]]:
    """The flush's additive UPDATEs as SQL text, one list per batch."""
    spec = get_spec(UNREAD_COUNTER)
    qn = connection.ops.quote_name
    table = qn(spec.model._meta.db_table)
    key = qn(column(spec.key_model_field))
    value = qn(column(model_field(spec.model, spec.value_field)))
    batches = []
    for batch in batched(list(deltas.items()), batch_size):
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
    """Median keys/s of the real flush and of the raw bound, alternating which goes first."""
    deltas = random_deltas(keys, seed=len(keys))
    batches = raw_batches(deltas, conf.batch_size())
    flush_s: list[float] = []
    raw_s: list[float] = []
    for r in range(rounds):
        if r % 2:
            raw_s.append(raw_apply(batches))
            flush_s.append(timed_flush(buffer, deltas))
        else:
            flush_s.append(timed_flush(buffer, deltas))
            raw_s.append(raw_apply(batches))
    flush_rate = len(keys) / statistics.median(flush_s)
    raw_rate = len(keys) / statistics.median(raw_s)
    return {
        "keys": len(keys),
        "batch_size": conf.batch_size(),
        "statements": sum(len(b) for b in batches),
        "flush_keys_per_s": round(flush_rate, 1),
        "raw_keys_per_s": round(raw_rate, 1),
        "flush_raw": round(flush_rate / raw_rate, 3),
        "rounds": {
            "flush_s": [round(s, 3) for s in flush_s],
            "raw_s": [round(s, 3) for s in raw_s],
        },
    }
