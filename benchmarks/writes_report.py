"""The writes section as tables: ops/s and ratios, other write paths, the cost per insert."""

from __future__ import annotations

from .writers import LIVE_MODES, MODES

WORKLOADS = ("spread", "hot")
#: Write modes beside off / naive / trigger / tally, each shown as its ratio to off and to tally.
EXTRA_MODES = ("per_commit", "durable", "sender", "batched", "waited", "floor", "live", "watched")
#: Columns of the cost table: every mode of the writers.
COST_MODES = MODES
COSTS = (
    ("writer CPU µs", "writer_cpu_us"),
    ("backend CPU µs", "backend_cpu_us"),
    ("WAL bytes", "wal_bytes"),
    ("Redis CPU µs", "redis_cpu_us"),
)


def load_text(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _num(value: float | None, width: int, digits: int) -> str:
    """``value`` right-aligned in ``width``; ``-`` when the figure is absent, ``n/a`` if None."""
    if value is None:
        return f"{'n/a':>{width}}"
    return f"{value:>{width}.{digits}f}"


def _get(r: dict, key: str, width: int, digits: int) -> str:
    return _num(r[key], width, digits) if key in r else f"{'-':>{width}}"


def writes_table(w: dict, cfg: dict) -> list[str]:
    """Every table of the writes section, one row per (writer count, workload) or per mode."""
    by_count = w.get("by_processes") or {str(cfg["processes"]): w}
    lines = _rates(w, cfg, by_count)
    lines += _extra(w, by_count)
    lines += _floor(by_count)
    lines += _costs(by_count)
    lines += _live(by_count)
    if "watched_ops" in w:
        ops, messages = w["watched_ops"], w["watched_messages"]
        # one per insert when each COMMIT pushes; with the sender, one per key of a push
        every = (
            "one per insert: yes"
            if messages == ops
            else f"one per key of each merged push: {ops / messages:.1f} inserts a message"
            if 0 < messages < ops and "watched_merged" in w
            else "one per insert: NO"
        )
        lines += [
            "",
            f"watched: {ops:,} inserts, {messages:,} messages received by the watcher; {every}",
        ]
    if "trigger_skipped" in w:
        lines += ["", f"note: {w['trigger_skipped']}"]
    elif "trigger_ops" in w:
        exact = "yes" if w["trigger_counts_exact"] else f"NO ({w['trigger_users_off']} users off)"
        lines += [
            "",
            f"trigger: {w['trigger_ops']:,} inserts, {w['trigger_counted_rows']:,} unread rows "
            f"checked; every counter row grew by its user's unread inserts: {exact}",
        ]
    return lines


def _rates(w: dict, cfg: dict, by_count: dict) -> list[str]:
    latency_modes = ("off", "naive", "trigger", "tally")
    lines = [
        f"writes: ops/s by writer processes, median of {cfg['rounds']} interleaved rounds of "
        f"{cfg['seconds']}s; ratios are medians of per-round ratios; latency of one insert "
        "(ms, p50 / p99, every operation); Redis server CPU per tally insert and EVALSHA "
        "calls per commit",
        f"{'procs':<6}{'workload':<9}{'off':>8}{'naive':>8}{'trigger':>8}{'tally':>8}"
        f"{'tally/off':>10}{'trigger/off':>12}{'tally/trigger':>14}{'tally/naive':>12}"
        + "".join(f"  {m + ' p50/p99':>15}" for m in latency_modes)
        + f"{'redis µs/push':>14}{'evalsha/commit':>15}   load",
    ]
    for count, result in by_count.items():
        for name in WORKLOADS:
            r = result[name]
            lat = "".join(
                f"  {r[f'{m}_p50_ms']:>7.2f}/{r[f'{m}_p99_ms']:<7.2f}"
                if f"{m}_p50_ms" in r
                else f"  {'-':>15}"
                for m in latency_modes
            )
            lines.append(
                f"{count:<6}{name:<9}"
                + "".join(
                    _get(r, f"{m}_ops_per_s", 8, 0) for m in ("off", "naive", "trigger", "tally")
                )
                + _get(r, "tally_off", 10, 2)
                + _get(r, "trigger_off", 12, 2)
                + _get(r, "tally_trigger", 14, 2)
                + _get(r, "tally_naive", 12, 2)
                + f"{lat}{r.get('redis_cpu_us_per_push', 0):>14.1f}"
                f"{r.get('evalsha_per_commit', 0):>15.2f}   "
                f"{load_text(result.get('load', w['load']))}"
            )
    return lines


def _extra(w: dict, by_count: dict) -> list[str]:
    extra = [m for m in EXTRA_MODES if f"{m}_ops_per_s" in next(iter(by_count.values()))["hot"]]
    if not extra:
        return []
    lines = [
        "",
        "other write paths, measured in the same rounds (sender: COUNTERS_SEND_DELAY_MS "
        f"{w.get('send_delay_ms', 0):g}):",
        f"{'procs':<6}{'workload':<9}{'mode':<9}{'ops/s':>8}{'/off':>7}{'/tally':>8}"
        f"  {'p50/p99 ms':>13}{'redis µs/push':>14}{'evalsha/commit':>15}",
    ]
    for count, result in by_count.items():
        for name in WORKLOADS:
            r = result[name]
            for mode in extra:
                cpu = r.get(f"{mode}_redis_cpu_us_per_push")
                calls = r.get(f"{mode}_evalsha_per_commit")
                server = (
                    f"{cpu:>14.1f}{calls:>15.2f}"
                    if cpu is not None and calls is not None
                    else f"{'-':>14}{'-':>15}"
                )
                lines.append(
                    f"{count:<6}{name:<9}{mode:<9}{r[f'{mode}_ops_per_s']:>8.0f}"
                    + _get(r, f"{mode}_off", 7, 2)
                    + _get(r, f"{mode}_tally", 8, 2)
                    + f"  {r.get(f'{mode}_p50_ms', 0):>6.2f}/{r.get(f'{mode}_p99_ms', 0):<6.2f}"
                    f"{server}"
                )
    return lines


def _floor(by_count: dict) -> list[str]:
    """What no buffered counter can go below (the ``floor`` mode), beside tally and the trigger."""
    if "floor_ops_per_s" not in next(iter(by_count.values()))["hot"]:
        return []
    lines = [
        "",
        "floor: the insert and one command sent to Redis after the COMMIT, nothing else;",
        "floor_push: the insert, a post_save receiver and, after the COMMIT, one call of",
        "Tally's push script under a push id (what its guarantees need), nothing else;",
        "floor_durable: floor with one outbox row INSERTed between them (durable mode's):",
        f"{'procs':<6}{'workload':<9}{'floor/off':>10}{'floor/trigger':>14}{'tally/floor':>12}"
        f"{'floor_push/off':>15}{'floor_push/trigger':>19}{'tally/floor_push':>17}"
        f"{'floor_durable/off':>18}{'durable/floor_durable':>22}"
        f"{'batched/trigger':>16}{'batched/floor':>14}",
    ]
    for count, result in by_count.items():
        for name in WORKLOADS:
            r = result[name]
            lines.append(
                f"{count:<6}{name:<9}"
                + _get(r, "floor_off", 10, 2)
                + _get(r, "floor_trigger", 14, 2)
                + _get(r, "tally_floor", 12, 2)
                + _get(r, "floor_push_off", 15, 2)
                + _get(r, "floor_push_trigger", 19, 2)
                + _get(r, "tally_floor_push", 17, 2)
                + _get(r, "floor_durable_off", 18, 2)
                + _get(r, "durable_floor_durable", 22, 2)
                + _get(r, "batched_trigger", 16, 2)
                + _get(r, "batched_floor", 14, 2)
            )
    return lines


def _live(by_count: dict) -> list[str]:
    """What a live counter adds to ``tally`` per insert, every round and the medians."""
    first = next(iter(by_count.values()))["hot"]
    modes = [m for m in LIVE_MODES if f"{m}_added_writer_cpu_us" in first]
    if not modes:
        return []
    lines = [
        "",
        "live counter: live: the unread counter live (in every other mode it is not), its "
        "keys unwatched; watched: every key written watched by one process of the bench's. "
        "Per insert, every round in order, then added to tally: the median of "
        "each round's difference (µs)",
    ]
    for count, result in by_count.items():
        for name in WORKLOADS:
            r = result[name]
            for label, figure in (("writer CPU", "writer_cpu"), ("Redis CPU", "redis_cpu")):
                for mode in ("tally", *modes):
                    runs = " ".join(_num(v, 7, 1) for v in r[f"{mode}_{figure}_rounds"])
                    lines.append(f"{count:<6}{name:<9}{label:<11}{mode:<8}{runs}")
            added = "  ".join(
                f"{m} writer {_num(r[f'{m}_added_writer_cpu_us'], 0, 1)} "
                f"Redis {_num(r[f'{m}_added_redis_cpu_us'], 0, 1)}"
                for m in modes
            )
            lines.append(f"{count:<6}{name:<9}added to tally: {added}")
    return lines


def _costs(by_count: dict) -> list[str]:
    first = next(iter(by_count.values()))
    modes = [m for m in COST_MODES if f"{m}_writer_cpu_us" in first["hot"]]
    if not modes:
        return []
    lines = [
        "",
        "cost per insert, over every recorded run: writer CPU (the writer processes, every "
        "thread), PostgreSQL backend CPU (the writers' backends, /proc/<pid>/stat), WAL bytes "
        "(pg_current_wal_lsn, the whole server's), Redis CPU (INFO cpu used_cpu_sys + "
        "used_cpu_user, the whole server's); n/a: not measurable here",
        f"{'procs':<6}{'workload':<9}{'per insert':<16}"
        + "".join(f"{m:>{_width(m)}}" for m in modes),
    ]
    for count, result in by_count.items():
        for name in WORKLOADS:
            r = result[name]
            for label, figure in COSTS:
                lines.append(
                    f"{count:<6}{name:<9}{label:<16}"
                    + "".join(_get(r, f"{m}_{figure}", _width(m), 1) for m in modes)
                )
    reasons = sorted({r["backend_cpu_na"] for r in by_count.values() if r.get("backend_cpu_na")})
    lines += [f"backend CPU n/a: {reason}" for reason in reasons]
    return lines + _pushes(first.get("push_settings") or {}, modes)


def _pushes(settings: dict[str, str], modes: list[str]) -> list[str]:
    """The merged-push setting of each mode, as its writers reported it."""
    shown = [m for m in modes if settings.get(m)]
    if not shown:
        return []
    width = max(len(m) for m in shown) + 2
    return ["", "merged pushes: how each mode's commits reached Redis in its writers"] + [
        f"  {m:<{width}}{settings[m]}" for m in shown
    ]


def _width(mode: str) -> int:
    """Characters of a mode's column in the cost table."""
    return max(9, len(mode) + 1)
