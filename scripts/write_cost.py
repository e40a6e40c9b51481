"""Where the CPU of one counted insert goes: the writer, its PostgreSQL backend, Redis.

One writer process, alone, inserts ``--inserts`` notifications per mode for one
user, in ``--rounds`` interleaved rounds, and reports per insert the median of:

- the writer's CPU time (``time.process_time``: Python, the client libraries and
  the kernel's share of its sockets; the sender's thread included);
- its PostgreSQL backend's CPU time (``/proc/<pid>/stat`` of
  ``pg_backend_pid()``, so PostgreSQL must run on the same machine);
- the Redis server's CPU time (``INFO cpu``, so give the run a Redis of its own);
- the wall time.

On a machine whose CPUs are all busy, throughput is the inverse of the sum of
the three CPU columns, so ``off``'s sum over a mode's sum predicts its ratio to
``off`` in ``counters_bench``::

    redis-server --port 6393 --save '' --appendonly no --bind 127.0.0.1 &
    DEBUG=0 DATABASE_URL=postgres://postgres@127.0.0.1:5432/tally_bench \\
        python scripts/write_cost.py --redis-url redis://127.0.0.1:6393/0

The modes are those of ``counters_bench``: ``off`` (no counter), ``naive`` (an
``F()`` update in the same transaction), ``tally`` (the defaults), ``durable``
(``COUNTERS_DURABLE``), ``sender`` (``COUNTERS_SEND_DELAY_MS`` = ``--send-delay``, 5)
and ``waited`` (``COUNTERS_DEFER_ACKS`` off: each push's reply read right after the COMMIT).

``floor`` (:class:`benchmarks.writers.Floor`) is the least a buffered counter
with Tally's guarantees can do per insert: ``off``'s insert, then one command
written to Redis after the COMMIT, its replies read 50 at a time. What it adds
to ``off`` is the send alone: the floor of what ``tally`` adds. ``floor_push``
(:class:`benchmarks.writers.PushFloor`) sends what Tally's guarantees need instead,
from a ``post_save`` receiver: one call of Tally's push script under a push id,
after the COMMIT. What it adds to ``off`` is the floor of what any counter with
those guarantees adds, Tally's Python aside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def redis_cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def profile(mode: str, ops: dict, uid: int, inserts: int, send_delay: float) -> int:
    """``inserts`` inserts of ``mode`` under ``cProfile``, by own time (wall, not CPU)."""
    import cProfile
    import pstats

    import counters
    from benchmarks.writers import set_mode

    set_mode(mode, send_delay)
    for _ in range(50):
        ops[mode](uid)
    counters.push_queued()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(inserts):
        ops[mode](uid)
    counters.push_queued()
    profiler.disable()
    set_mode("tally", 0)
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumtime").print_stats("counters/", 25)  # Tally's own calls
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inserts", type=int, default=2000, help="inserts per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="off,floor,naive,tally,waited,durable,sender")
    parser.add_argument("--send-delay", type=float, default=5.0, help="ms, of the sender mode")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    parser.add_argument(
        "--profile",
        metavar="MODE",
        help="instead: cProfile one round of MODE and print its 25 costliest functions, "
        "and Tally's 25 costliest calls",
    )
    args = parser.parse_args()

    os.environ["COUNTERS_REDIS_URL"] = args.redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import redis
    from django.contrib.auth import get_user_model
    from django.db import connection

    import counters
    from benchmarks.writers import FLOOR_MODES, Floor, drop_floor_keys, operations, set_mode
    from notifications.models import Notification

    if connection.vendor != "postgresql":
        parser.error("needs PostgreSQL on this machine (DATABASE_URL=postgres://...)")
    server = redis.Redis.from_url(args.redis_url)
    user, _ = get_user_model().objects.get_or_create(username="write-cost")
    ops = operations()
    modes = args.modes.split(",")
    unknown = set(modes) - set(ops)
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]

    def clocks() -> tuple[float, float, float, float]:
        """Writer CPU, backend CPU, Redis CPU, wall clock (seconds)."""
        return time.process_time(), backend_cpu(backend), redis_cpu(server), time.perf_counter()

    if args.profile:
        return profile(args.profile, ops, user.pk, args.inserts, args.send_delay)
    results: dict[str, list[tuple[float, ...]]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for mode in modes[round_ % len(modes) :] + modes[: round_ % len(modes)]:
            set_mode(mode, args.send_delay)
            op = ops[mode]
            if isinstance(op, Floor):
                op.begin()
            for _ in range(50):  # warm up the mode's code paths and caches
                op(user.pk)
            counters.push_queued()
            before = clocks()
            for _ in range(args.inserts):
                op(user.pk)
            counters.push_queued()
            for name in FLOOR_MODES:
                ops[name].finish()  # type: ignore[attr-defined]
            after = clocks()
            spent = (b - a for a, b in zip(before, after, strict=True))
            results[mode].append(tuple(t / args.inserts for t in spent))
        counters.flush()
    set_mode("tally", 0)
    Notification.objects.filter(recipient=user).delete()
    counters.flush()
    drop_floor_keys(counters.get_client(), counters.get_buffer().prefix)

    def us(values: list[float]) -> float:
        return statistics.median(values) * 1e6

    print(f"one writer, {args.inserts} inserts x {args.rounds} rounds, µs per insert")
    header = ("mode", "writer", "postgres", "redis", "cpu sum", "wall", "off/mode (cpu)")
    print("{:<11} {:>7} {:>9} {:>6} {:>8} {:>7} {:>15}".format(*header))
    sums = {m: sum(us([r[i] for r in results[m]]) for i in range(3)) for m in modes}
    for mode in modes:
        cols = [us([r[i] for r in results[mode]]) for i in range(4)]
        ratio = f"{sums['off'] / sums[mode]:.2f}" if "off" in sums else "-"
        row = (mode, *(f"{c:.0f}" for c in (*cols[:3], sums[mode], cols[3])), ratio)
        print("{:<11} {:>7} {:>9} {:>6} {:>8} {:>7} {:>15}".format(*row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
