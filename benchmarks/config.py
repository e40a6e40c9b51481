"""Sizes and durations of one bench run."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

#: ``COUNTERS_SEND_DELAY_MS`` of the ``sender`` write mode by default, in milliseconds.
SENDER_DELAY_MS = 5.0
#: ``COUNTERS_WRITE_BATCH`` of the ``batched`` write mode.
BATCHED_WRITE = 16
SECTIONS = ("writes", "flush", "parallel", "reads", "async", "memory", "idempotency")


@dataclass(frozen=True)
class BenchConfig:
    #: Writer processes; with ``process_counts``, the largest of them.
    processes: int = 8
    #: Writer counts the writes are measured at, one after the other (``--processes 2,4,8``);
    #: empty: ``processes`` alone.
    process_counts: tuple[int, ...] = ()
    #: Length of one measured write run, in seconds.
    seconds: float = 2.0
    #: Interleaved rounds of every (workload, mode) pair.
    rounds: int = 5
    #: ``COUNTERS_SEND_DELAY_MS`` of the ``sender`` write mode.
    send_delay_ms: float = SENDER_DELAY_MS
    #: Unrecorded run of every pair before the first round, in seconds.
    warmup: float = 0.5
    spread_users: int = 10_000
    flush_keys: int = 100_000
    flush_rounds: int = 4
    #: Pending keys of the parallel flush, and the flusher counts measured on them.
    parallel_keys: int = 100_000
    parallel_workers: tuple[int, ...] = (1, 2, 4)
    parallel_rounds: int = 3
    read_notifications: int = 1_000_000
    read_unread: int = 10_000
    read_samples: int = 200
    #: Keys of the async reads, reads per run, tasks at once, and interleaved rounds.
    async_keys: int = 100
    async_reads: int = 4_000
    async_concurrency: tuple[int, ...] = (1, 8, 32)
    async_rounds: int = 5
    memory_small: int = 10_000
    memory_large: int = 1_000_000
    #: Pushes of the idempotency section per scheme (then three times as many), and its threads.
    idem_pushes: int = 100_000
    idem_threads: int = 4
    quick: bool = False
    #: Write modes to measure (``--modes``); empty: :data:`benchmarks.writers.DEFAULT_MODES`.
    modes: tuple[str, ...] = ()

    @classmethod
    def full(cls, **overrides: Any) -> BenchConfig:
        return replace(cls(), **overrides)

    @classmethod
    def quick_run(cls, **overrides: Any) -> BenchConfig:
        """Sizes for CI: every figure, in a few seconds."""
        small = cls(
            processes=2,
            seconds=0.3,
            rounds=1,
            warmup=0.0,
            spread_users=1_000,
            flush_keys=2_000,
            flush_rounds=1,
            parallel_keys=2_000,
            parallel_rounds=1,
            read_notifications=20_000,
            read_unread=1_000,
            read_samples=20,
            async_keys=10,
            async_reads=64,
            async_concurrency=(1, 8),
            async_rounds=1,
            memory_small=500,
            memory_large=5_000,
            idem_pushes=2_000,
            quick=True,
        )
        return replace(small, **overrides)

    def write_modes(self) -> tuple[str, ...]:
        """The write modes to measure, in the order of :data:`benchmarks.writers.MODES`."""
        from .writers import DEFAULT_MODES, MODES

        return tuple(m for m in MODES if m in self.modes) if self.modes else DEFAULT_MODES

    def writer_counts(self) -> tuple[int, ...]:
        """The writer counts to measure, smallest first."""
        return self.process_counts or (self.processes,)

    def users_needed(self, sections: tuple[str, ...]) -> int:
        """Bench users the chosen sections key their counters on."""
        sizes = [1]
        if "writes" in sections:
            sizes.append(self.spread_users)
        if "flush" in sections:
            sizes.append(self.flush_keys)
        if "parallel" in sections:
            sizes.append(self.parallel_keys)
        if "reads" in sections:
            sizes.append(self.spread_users)
        if "async" in sections:
            sizes.append(self.async_keys)
        if "memory" in sections:
            sizes.append(self.memory_large)
        return max(sizes)
