"""What a live counter adds to a counted insert: the writer's CPU and Redis's, live or not.

One writer process inserts ``--inserts`` notifications of one user per mode, in
``--rounds`` interleaved rounds, with the unread counter not live (``tally``) and
live (``live``: its pushes name the shard channel and the script publishes on it),
while a subscriber process of every shard channel (as a web process holds) reads what
is published. Reports per insert the median of the writer's CPU (``time.process_time``),
the Redis server's (``INFO cpu``: give the run a Redis of its own), and the wall time,
and what ``live`` adds to ``tally``::

    redis-server --port 6393 --save '' --appendonly no --bind 127.0.0.1 &
    DEBUG=0 DATABASE_URL=postgres://postgres@127.0.0.1:5432/tally_bench \\
        python scripts/live_cost.py --redis-url redis://127.0.0.1:6393/0

With ``--pushes N``, Redis alone instead (no Django, no database): ``N`` calls of the
push script of one member per mode and round, each waited for, not live and live (its
channel as a fourth key, the subscriber reading it), and Redis's CPU per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def redis_cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def subscribe(url: str, channels: list[str]) -> subprocess.Popen:
    """A process of its own (its CPU is not the writer's) reading every message published
    on ``channels``, as a web process's subscriber does."""
    code = (
        "import sys, redis\n"
        "p = redis.Redis.from_url(sys.argv[1]).pubsub()\n"
        "[p.ssubscribe(c) for c in sys.argv[2:]]\n"
        "for m in p.listen(): pass\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, url, *channels])


def pushes(url: str, calls: int, rounds: int) -> int:
    """Redis's CPU per push of one member, not live and live (see the module)."""
    import redis

    sys.path.insert(0, str(ROOT / "scripts"))
    from push_redis_cpu import MAX_AGE_MS, TTL_MS, timed

    client = redis.Redis.from_url(url)
    sha = client.script_load((ROOT / "counters/buffer/lua/push.lua").read_text())
    keys = tuple(f"live-cost:{{s0}}:{name}" for name in ("pending", "w:bench", "since"))
    channel = "live-cost:{s0}:live"
    reader = subscribe(url, [channel])
    seq = 0

    def push(extra: tuple[str, ...]) -> Callable[[int], object]:
        def send(i: int) -> object:
            nonlocal seq
            seq += 1
            now = int(time.time() * 1000)
            args = (TTL_MS, now, MAX_AGE_MS, seq, f"unread:{i % 5000}", 1)
            return client.evalsha(sha, 3 + len(extra), *keys, *extra, *args)

        return send

    modes = {"tally": push(()), "live": push((channel,))}
    results: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for r in range(rounds):
            for name in ("tally", "live") if r % 2 else ("live", "tally"):
                results[name].append(timed(client, calls, modes[name])[0])
    finally:
        client.delete(*keys)
        reader.terminate()
        reader.wait()
    cpu = {m: statistics.median(v) for m, v in results.items()}
    print(f"{calls} pushes x {rounds} rounds, Redis CPU µs per push (median)")
    print(
        f"tally {cpu['tally']:.1f}  live {cpu['live']:.1f}  added {cpu['live'] - cpu['tally']:+.1f}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inserts", type=int, default=2000, help="inserts per mode and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    parser.add_argument("--pushes", type=int, default=0, help="instead: Redis alone, N calls")
    args = parser.parse_args()
    if args.pushes:
        return pushes(args.redis_url, args.pushes, args.rounds)

    os.environ["COUNTERS_REDIS_URL"] = args.redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import redis
    from django.contrib.auth import get_user_model

    import counters
    from benchmarks.internals import live
    from benchmarks.writers import operations, set_mode
    from notifications.apps import UNREAD_COUNTER
    from notifications.models import Notification

    server = redis.Redis.from_url(args.redis_url)
    buffer = counters.get_buffer()
    channels = [live.channel(buffer.prefix, shard) for shard in range(buffer.shards)]
    reader = subscribe(args.redis_url, channels)
    deadline = time.monotonic() + 10
    while server.execute_command("PUBSUB", "SHARDNUMSUB", channels[-1])[1] == 0:
        if time.monotonic() > deadline:
            raise SystemExit("the subscriber did not subscribe")
        time.sleep(0.05)
    user, _ = get_user_model().objects.get_or_create(username="live-cost")
    insert = operations()["tally"]
    set_mode("tally", 0)
    modes = {"tally": set(), "live": {UNREAD_COUNTER}}
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for mode in ("tally", "live") if round_ % 2 else ("live", "tally"):
            live.LIVE_COUNTERS.clear()
            live.LIVE_COUNTERS.update(modes[mode])
            for _ in range(50):  # warm up the mode's code paths and caches
                insert(user.pk)
            counters.push_queued()
            before = (time.process_time(), redis_cpu(server), time.perf_counter())
            for _ in range(args.inserts):
                insert(user.pk)
            counters.push_queued()
            after = (time.process_time(), redis_cpu(server), time.perf_counter())
            spent = tuple((b - a) / args.inserts for a, b in zip(before, after, strict=True))
            results[mode].append(spent)  # type: ignore[arg-type]
        counters.flush()
    Notification.objects.filter(recipient=user).delete()
    counters.flush()
    reader.terminate()
    reader.wait()

    def us(mode: str, i: int) -> float:
        return statistics.median(r[i] for r in results[mode]) * 1e6

    print(f"one writer, {args.inserts} inserts x {args.rounds} rounds, µs per insert (median)")
    print("a subscriber process read every shard channel")
    print("{:<8} {:>7} {:>6} {:>7}".format("mode", "writer", "redis", "wall"))
    for mode in modes:
        print("{:<8} {:>7.1f} {:>6.1f} {:>7.1f}".format(mode, *(us(mode, i) for i in range(3))))
    extra = [us("live", i) - us("tally", i) for i in range(3)]
    print("{:<8} {:>+7.1f} {:>+6.1f} {:>+7.1f}".format("added", *extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
