"""Memory: the flusher's peak RSS, in a fresh process, for a small and a large backlog."""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from .child import ChildContext, peak_rss_kb
from .errors import BenchError

if TYPE_CHECKING:
    from .internals import Buffer


class FlusherFailed(BenchError):
    """The flusher process failed or vanished."""


def flusher_main(conn: Connection, context: ChildContext) -> None:
    """Body of the flusher process: one real flush of the bench buffer, then its peak RSS."""
    try:
        context.setup()
        from django.db import connection

        import counters

        from . import flush as bench_flush

        connection.ensure_connection()
        buffer = counters.get_buffer()
        buffer.client.ping()
        baseline = peak_rss_kb()
        started = time.perf_counter()
        with bench_flush.recorded_batch_ids() as batch_ids:
            result = bench_flush.real_flush(buffer)
        seconds = time.perf_counter() - started
        peak = peak_rss_kb()
        bench_flush.delete_ledger_rows(batch_ids)
        conn.send(("done", (baseline, peak, result.keys, result.dropped, seconds)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def flusher_run(context: ChildContext, timeout: float) -> tuple[int, int, int, int, float]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=flusher_main, args=(child, context), name="bench-flusher")
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise FlusherFailed(f"flusher did not finish within {timeout:.0f}s")
        kind, value = parent.recv()
    except EOFError as exc:
        proc.join(timeout=5)
        raise FlusherFailed(f"flusher exited (status {proc.exitcode})") from exc
    finally:
        if proc.is_alive():
            proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        parent.close()
    if kind == "error":
        raise FlusherFailed(value)
    return value


def measure(buffer: Buffer, context: ChildContext, users: list[int], sizes: list[int]) -> dict:
    """Peak RSS of a flusher draining ``size`` pending keys (+1 each), for each size."""
    from . import flush

    runs = {}
    for size in sizes:
        flush.seed_pending(buffer, dict.fromkeys(users[:size], 1))
        baseline, peak, keys, dropped, seconds = flusher_run(context, timeout=600 + size / 100)
        if keys != size or dropped:
            raise FlusherFailed(f"flusher applied {keys} keys ({dropped} dropped) of {size}")
        runs[size] = {
            "keys": size,
            "baseline_mb": round(baseline / 1024, 1),
            "peak_mb": round(peak / 1024, 1),
            "flush_s": round(seconds, 3),
            "keys_per_s": round(size / seconds, 1),
        }
    small, large = runs[min(sizes)], runs[max(sizes)]
    return {
        "small": small,
        "large": large,
        "growth_mb": round(large["peak_mb"] - small["peak_mb"], 1),
    }
