"""Parallel flush: keys/s with 1, 2 and 4 flusher processes, each on a disjoint shard set.

Each flusher is what a Celery worker running ``counters.flush_shards`` is: a
spawned process with its own database connection and Redis client, running
``counters.ops.fanout.flush_part`` on the shards of its part
(``counters.ops.fanout.partition``). The Celery transport is left out: sending N
tasks costs milliseconds a run.

The processes are started and set up once, before any clock runs. One
measurement seeds the same pending keys, starts N flushers at one wall-clock
instant, and ends when the last one is done: keys/s = keys / (last end -
start). Every round measures every worker count, the order rotating from round
to round; a figure is the median over rounds, and a speed-up is the median of
the per-round ratios (measurements of one round are seconds apart, so they
share the machine's other load).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from .child import ChildContext
from .errors import BenchError

if TYPE_CHECKING:
    from .internals import Buffer

#: Seconds between sending a measurement to the flushers and its start in all of them.
START_DELAY = 0.1


class ParallelFlushFailed(BenchError):
    """A flusher process failed, vanished, or did not apply what was pending."""


@dataclass(frozen=True)
class Part:
    """One flusher's share of a measurement."""

    run: str
    index: int
    parts: int
    shards: tuple[int, ...]
    start_at: float


@dataclass(frozen=True)
class PartDone:
    keys: int
    dropped: int
    busy: int
    end: float


def flusher_main(conn: Connection, context: ChildContext) -> None:
    """Body of one flusher process: answer every :class:`Part` with a :class:`PartDone`."""
    try:
        context.setup()
        from django.db import DEFAULT_DB_ALIAS, connection

        import counters

        from . import flush as bench_flush
        from .internals import flush_part

        connection.ensure_connection()
        counters.get_buffer().client.ping()
    except Exception as exc:
        conn.send(("error", f"setup: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while (part := conn.recv()) is not None:
        try:
            time.sleep(max(0.0, part.start_at - time.time()))
            with bench_flush.recorded_batch_ids() as batch_ids:
                result = flush_part(
                    using=DEFAULT_DB_ALIAS,
                    shards=part.shards,
                    run=part.run,
                    index=part.index,
                    parts=part.parts,
                    time_budget=3600.0,
                )
            end = time.time()
            # The shared ledger keeps nothing of the bench.
            bench_flush.delete_ledger_rows(batch_ids)
            done = PartDone(result.keys, result.dropped, len(result.busy_shards), end)
            conn.send(("done", done))
        except Exception as exc:
            conn.send(("error", f"part {part.index}: {type(exc).__name__}: {exc}"))
    connection.close()


class FlusherPool:
    """``size`` flusher processes, started once and driven measurement by measurement."""

    def __init__(self, size: int, context: ChildContext, timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.timeout = timeout
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=flusher_main, args=(child, context), name=f"bench-flush-{i}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        for i in range(size):
            self._receive(i, "ready")

    def _receive(self, i: int, expected: str) -> Any:
        conn = self.conns[i]
        try:
            if not conn.poll(self.timeout):
                raise ParallelFlushFailed(f"flusher {i} did not answer within {self.timeout:.0f}s")
            kind, value = conn.recv()
        except EOFError as exc:
            raise ParallelFlushFailed(
                f"flusher {i} exited (status {self.procs[i].exitcode})"
            ) from exc
        if kind != expected:
            raise ParallelFlushFailed(f"flusher {i}: {value}")
        return value

    def run(self, run: str, parts: list[list[int]]) -> tuple[float, list[PartDone]]:
        """Flush ``parts`` (one flusher each) from one instant; seconds to the last end."""
        start_at = time.time() + START_DELAY
        for i, shards in enumerate(parts):
            self.conns[i].send(Part(run, i, len(parts), tuple(shards), start_at))
        done = [self._receive(i, "done") for i in range(len(parts))]
        return max(d.end for d in done) - start_at, done

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()


def measure(
    buffer: Buffer,
    context: ChildContext,
    keys: list[int],
    workers: tuple[int, ...],
    rounds: int,
) -> dict:
    """Median keys/s of the flush with each number of ``workers``, over ``rounds`` rounds."""
    from . import flush
    from .internals import conf, partition

    deltas = flush.random_deltas(keys, seed=len(keys))
    seconds: dict[int, list[float]] = {n: [] for n in workers}
    pool = FlusherPool(max(workers), context, timeout=600 + len(keys) / 100)
    try:
        for r in range(rounds):
            order = workers[r % len(workers) :] + workers[: r % len(workers)]
            for n in order:
                flush.seed_pending(buffer, deltas)
                parts = partition(buffer.shards, n)
                took, done = pool.run(f"bench-{r}-{n}", parts)
                applied = sum(d.keys for d in done)
                if applied != len(keys) or any(d.dropped or d.busy for d in done):
                    raise ParallelFlushFailed(
                        f"{n} flushers applied {applied} keys of {len(keys)} "
                        f"({sum(d.dropped for d in done)} dropped, "
                        f"{sum(d.busy for d in done)} shards busy)"
                    )
                seconds[n].append(took)
    finally:
        pool.close()
    base = workers[0]
    per_worker = {
        str(n): {
            "parts": len(partition(buffer.shards, n)),
            "keys_per_s": round(len(keys) / statistics.median(seconds[n]), 1),
            "rounds_s": [round(s, 3) for s in seconds[n]],
        }
        for n in workers
    }
    speedup = {
        str(n): round(
            statistics.median(b / s for b, s in zip(seconds[base], seconds[n], strict=True)), 2
        )
        for n in workers
    }
    return {
        "keys": len(keys),
        "shards": buffer.shards,
        "batch_size": conf.batch_size(),
        "rounds": rounds,
        "workers": per_worker,
        "speedup": speedup,
        "speedup_base": base,
    }
