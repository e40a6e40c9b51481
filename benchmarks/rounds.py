"""Interleaved rounds of every (workload, mode): rates, ratios, latency and the cost per insert."""

from __future__ import annotations

import statistics
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from .probes import Cost, CostProbe, RedisUsage
from .trigger import CounterTrigger
from .watchers import Watcher
from .writers import LIVE_MODES, WORKLOADS, WriterPool, percentile

#: Modes whose EVALSHA calls are shown (Redis's CPU is sampled in every run of every mode).
SAMPLED = ("tally", "per_commit", "sender", "batched", "floor_push", "live", "watched")
#: Ratios of ops/s, each the median of its per-round ratios: (numerator, denominator).
RATIOS = (
    ("tally", "off"),
    ("tally", "naive"),
    ("trigger", "off"),
    ("tally", "trigger"),
    ("durable", "off"),
    ("durable", "tally"),
    ("per_commit", "off"),
    ("tally", "per_commit"),
    ("sender", "off"),
    ("sender", "tally"),
    ("batched", "off"),
    ("batched", "trigger"),
    ("batched", "tally"),
    ("batched", "floor"),
    ("waited", "off"),
    ("waited", "tally"),
    ("tally", "waited"),
    ("floor", "off"),
    ("floor", "tally"),
    ("floor", "trigger"),
    ("tally", "floor"),
    ("floor_push", "off"),
    ("floor_push", "trigger"),
    ("tally", "floor_push"),
    ("floor_durable", "off"),
    ("durable", "floor_durable"),
    ("live", "tally"),
    ("watched", "tally"),
)


@dataclass(frozen=True)
class Probes:
    """What is sampled around the runs besides their rate: the costs (the buffer's Redis
    among them, when sampled at all)."""

    costs: CostProbe
    #: The trigger of the ``trigger`` mode, installed around each of its runs.
    trigger: CounterTrigger | None = None
    #: The process that watches every key written, started around each ``watched`` run.
    watcher: Watcher | None = None


@dataclass
class Kept:
    """What the recorded runs of one (workload, mode) add up to."""

    rates: list[float]
    cost: Cost
    redis: RedisUsage
    #: Per recorded run: writer CPU µs and Redis CPU µs per insert (None: not sampled).
    runs: list[tuple[float, float | None]] = field(default_factory=list)


def run_once(
    pool: WriterPool, mode: str, workload: str, seconds: float, probes: Probes, kept: Kept | None
) -> float:
    """One run of every writer, the trigger installed around it in ``trigger`` mode; ops/s.

    ``kept`` (None for warm-up runs) receives the rate, the cost and the Redis usage.
    """
    installed: AbstractContextManager[object] = nullcontext()
    if mode == "trigger":
        if probes.trigger is None:
            raise ValueError("the trigger mode needs the trigger")
        installed = probes.trigger.counting()
    elif mode == "watched":
        if probes.watcher is None:
            raise ValueError("the watched mode needs the watcher")
        installed = probes.watcher
    with installed:
        before = probes.costs.sample()
        totals = pool.run(mode, workload, seconds, record=kept is not None)
        after = probes.costs.sample()
        if kept is not None:
            kept.rates.append(totals.rate)
            kept.cost.add(totals.ops, totals.cpu_s, before, after)
            redis = None
            if before.redis is not None and after.redis is not None:
                redis = (after.redis.cpu_s - before.redis.cpu_s) * 1e6 / max(totals.ops, 1)
                if mode in SAMPLED:
                    kept.redis.add(before.redis, after.redis, totals.ops)
            kept.runs.append((totals.cpu_s * 1e6 / max(totals.ops, 1), redis))
    return totals.rate


def measure(
    pool: WriterPool,
    modes: tuple[str, ...],
    rounds: int,
    seconds: float,
    warmup: float,
    probes: Probes,
) -> dict:
    """Interleaved rounds of every (workload, mode); median ops/s and ratios per workload.

    The order of the modes rotates from round to round. A ratio is the median of
    the per-round ratios: the runs of one round are adjacent in time, so they
    share whatever else the machine was doing. The p50 and p99 latency of one
    operation are over every operation of every writer in every round; the cost
    per insert (writer CPU, backend CPU, WAL) over every recorded run.
    """
    if warmup > 0:
        for workload in WORKLOADS:
            for mode in modes:
                run_once(pool, mode, workload, warmup, probes, None)
    kept = {(w, m): Kept([], Cost(), RedisUsage()) for w in WORKLOADS for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for workload in WORKLOADS:
            for mode in order:
                run_once(pool, mode, workload, seconds, probes, kept[(workload, mode)])
    return {
        workload: _figures(pool, workload, modes, kept, probes.costs.redis is not None)
        for workload in WORKLOADS
    }


def _figures(
    pool: WriterPool,
    workload: str,
    modes: tuple[str, ...],
    kept: dict[tuple[str, str], Kept],
    redis: bool,
) -> dict:
    rates = {mode: kept[(workload, mode)].rates for mode in modes}
    figures: dict = {
        f"{mode}_ops_per_s": round(statistics.median(v), 1) for mode, v in rates.items()
    }
    for top, bottom in RATIOS:
        if top in rates and bottom in rates:
            figures[f"{top}_{bottom}"] = round(_ratio(rates[top], rates[bottom]), 3)
    for mode in modes:
        latencies = pool.latencies.get((workload, mode), [])
        figures[f"{mode}_p50_ms"] = round(percentile(latencies, 0.50) * 1000, 3)
        figures[f"{mode}_p99_ms"] = round(percentile(latencies, 0.99) * 1000, 3)
    for mode in modes:
        figures.update(kept[(workload, mode)].cost.figures(mode))
    if redis:
        figures.update(kept[(workload, "tally")].redis.figures())
        for other in SAMPLED[1:]:
            if other in modes:
                usage = kept[(workload, other)].redis.figures()
                figures.update({f"{other}_{k}": v for k, v in usage.items()})
    figures["rounds"] = {mode: [round(v, 1) for v in values] for mode, values in rates.items()}
    if "tally" in modes and any(m in modes for m in LIVE_MODES):
        figures.update(_live(modes, {m: kept[(workload, m)].runs for m in modes}))
    return figures


def _live(modes: tuple[str, ...], runs: dict[str, list[tuple[float, float | None]]]) -> dict:
    """What a live counter adds to ``tally``, per insert: every round's writer CPU and Redis
    CPU of ``tally`` and the live modes, and the median of each round's difference."""
    figures: dict = {}
    shown = ("tally", *(m for m in LIVE_MODES if m in modes))
    for mode in shown:
        figures[f"{mode}_writer_cpu_rounds"] = [round(w, 1) for w, _ in runs[mode]]
        figures[f"{mode}_redis_cpu_rounds"] = [
            None if r is None else round(r, 1) for _, r in runs[mode]
        ]
    for mode in shown[1:]:
        pairs = list(zip(runs[mode], runs["tally"], strict=True))
        figures[f"{mode}_added_writer_cpu_us"] = round(
            statistics.median(w - t for (w, _), (t, _) in pairs), 1
        )
        redis = [(r, t) for (_, r), (_, t) in pairs if r is not None and t is not None]
        figures[f"{mode}_added_redis_cpu_us"] = (
            round(statistics.median(r - t for r, t in redis), 1) if redis else None
        )
    return figures


def _ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))
