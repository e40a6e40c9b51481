"""What a live counter adds to a counted insert: the writer's CPU and Redis's, by who watches.

One writer process inserts ``--inserts`` notifications per mode, spread over ``--users``
recipients, in ``--rounds`` interleaved rounds (the order of the modes turns each round),
in four modes:

- ``tally``: the unread counter is not live;
- ``live``: it is live (its pushes publish each member on its channel), nobody watches;
- ``others``: live, and a subscriber process holds what a web process's dispatcher holds
  for ``--others`` watched keys that are not written (their channels);
- ``watched``: the same, and the keys written are watched too (each change is sent).

The subscriber is a process of its own (its CPU is not the writer's), started before each
mode's inserts and ended after them. Reports, per insert and per mode, the median of the
writer's CPU (``time.process_time``), the Redis server's (``INFO cpu``: give the run a Redis
of its own), and the wall time, every run, and what each mode adds to ``tally``::

    redis-server --port 6393 --save '' --appendonly no --bind 127.0.0.1 &
    DEBUG=0 DATABASE_URL=postgres://postgres@127.0.0.1:5432/tally_bench \\
        python scripts/live_cost.py --redis-url redis://127.0.0.1:6393/0

With ``--pushes N``, Redis alone instead (no Django, no database): ``N`` calls of the push
script of one member per mode and round (members spread over 5000 keys), each waited for,
in the same four modes, and Redis's CPU per call. With ``--encode N``, the writer's side
alone: the CPU of encoding ``N`` one-member pushes (what the writer does per push besides
sending it), a member of a counter that is not live against one of a live counter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("tally", "live", "others", "watched")
#: Distinct members of the pushes of ``--pushes``.
SPREAD = 5000


def redis_cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def subscribe(url: str, channels: Sequence[str]) -> subprocess.Popen:
    """A process of its own (its CPU is not the writer's) subscribed to ``channels`` and
    reading every message published on them, as a web process's dispatcher does."""
    code = (
        "import sys, redis\n"
        "p = redis.Redis.from_url(sys.argv[1]).pubsub()\n"
        "names = sys.stdin.read().split()\n"
        "for i in range(0, len(names), 500): p.ssubscribe(*names[i:i + 500])\n"
        "for m in p.listen(): pass\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, url], stdin=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write("\n".join(channels))
    proc.stdin.close()
    return proc


def subscribed(client, channels: Sequence[str]) -> None:
    """Wait until Redis has the last of ``channels`` subscribed to."""
    deadline = time.monotonic() + 20
    while client.execute_command("PUBSUB", "SHARDNUMSUB", channels[-1])[1] == 0:
        if time.monotonic() > deadline:
            raise SystemExit("the subscriber did not subscribe")
        time.sleep(0.05)


class Subscriber:
    """The subscriber process of a mode: none, the others' channels, or those and the
    written members' channels."""

    def __init__(self, url: str, client, others: list[str], written: list[str]) -> None:
        self.url, self.client, self.others, self.written = url, client, others, written
        self.proc: subprocess.Popen | None = None

    def start(self, mode: str) -> None:
        channels = {"others": self.others, "watched": self.others + self.written}.get(mode)
        if channels:
            self.proc = subscribe(self.url, channels)
            subscribed(self.client, channels)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None


def order(round_: int) -> list[str]:
    """The modes of round ``round_``: turned by one each round."""
    k = round_ % len(MODES)
    return list(MODES[k:] + MODES[:k])


def report(title: str, columns: Sequence[str], results: dict[str, list[tuple]]) -> None:
    """Every run, the medians, and what each mode adds to ``tally`` (µs)."""
    print(title)
    print("runs:")
    for mode in MODES:
        for i, column in enumerate(columns):
            runs = " ".join(f"{r[i] * 1e6:6.1f}" for r in results[mode])
            print(f"  {mode:<8} {column:<7} {runs}")
    medians = {m: [statistics.median(r[i] for r in results[m]) * 1e6 for i in range(len(columns))]
               for m in MODES}  # fmt: skip
    print("medians:")
    print(f"  {'mode':<8} " + " ".join(f"{c:>8}" for c in columns))
    for mode in MODES:
        print(f"  {mode:<8} " + " ".join(f"{v:8.1f}" for v in medians[mode]))
    print("added to tally (difference of the medians; median of each round's difference):")
    for mode in MODES[1:]:
        added = [m - t for m, t in zip(medians[mode], medians["tally"], strict=True)]
        pairs = list(zip(results[mode], results["tally"], strict=True))
        paired = [
            statistics.median((r[i] - t[i]) * 1e6 for r, t in pairs) for i in range(len(columns))
        ]
        print(
            f"  {mode:<8} "
            + " ".join(f"{a:+8.1f} ({p:+.1f})" for a, p in zip(added, paired, strict=True))
        )


def pushes(url: str, calls: int, rounds: int, others: int) -> int:
    """Redis's CPU per push of one member, in each mode (see the module)."""
    import redis

    sys.path.insert(0, str(ROOT / "scripts"))
    from push_redis_cpu import MAX_AGE_MS, TTL_MS, timed

    client = redis.Redis.from_url(url)
    sha = client.script_load((ROOT / "counters/buffer/lua/push.lua").read_text())
    keys = tuple(f"live-cost:{{s0}}:{name}" for name in ("pending", "w:bench", "since", "suspects"))
    base = "live-cost:{s0}:live:"
    subscriber = Subscriber(
        url,
        client,
        [f"{base}unread:other:{i}" for i in range(others)],
        [f"{base}unread:{i}" for i in range(SPREAD)],
    )
    seq = 0

    def push(extra: tuple[str, ...]) -> Callable[[int], object]:
        def send(i: int) -> object:
            nonlocal seq
            seq += 1
            now = int(time.time() * 1000)
            args = (TTL_MS, now, MAX_AGE_MS, seq, f"unread:{i % SPREAD}", 1)
            return client.evalsha(sha, 4 + len(extra), *keys, *extra, *args)

        return send

    sends = {"tally": push(())} | {mode: push((base,)) for mode in MODES[1:]}
    results: dict[str, list[tuple]] = {m: [] for m in MODES}
    try:
        for r in range(rounds):
            for mode in order(r):
                subscriber.start(mode)
                try:
                    results[mode].append((timed(client, calls, sends[mode])[0] / 1e6,))
                finally:
                    subscriber.stop()
    finally:
        client.delete(*keys)
    report(
        f"{calls} pushes of one member x {rounds} rounds, Redis CPU µs per push "
        f"(others: {others} other keys' channels subscribed)",
        ["redis"],
        results,
    )
    return 0


def encode(calls: int, rounds: int) -> int:
    """The writer's CPU per one-member push encoded, a member not live against a live one."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import counters
    from benchmarks.internals import live

    buffer = counters.get_buffer()
    live.LIVE_COUNTERS.add("unread")
    members = {
        "tally": [f"other:{i}" for i in range(500)],
        "live": [f"unread:{i}" for i in range(500)],
    }
    results: dict[str, list[float]] = {"tally": [], "live": []}
    for r in range(rounds):
        for mode in ("tally", "live") if r % 2 else ("live", "tally"):
            names = members[mode]
            started = time.process_time()
            for i in range(calls):
                buffer.plan_push({names[i % 500]: 1}, f"w{i % 4}:{i + 1}")
            results[mode].append((time.process_time() - started) / calls * 1e6)
    print(f"{calls} one-member pushes planned and encoded x {rounds} rounds, writer CPU µs")
    for mode, runs in results.items():
        each = " ".join(f"{v:5.2f}" for v in runs)
        print(f"  {mode:<6} {each}  median {statistics.median(runs):.2f}")
    added = statistics.median(results["live"]) - statistics.median(results["tally"])
    print(f"  added {added:+.2f}")
    return 0


def channels(prefix: str, shards: int, members: Iterable[str]) -> list[str]:
    from zlib import crc32

    from benchmarks.internals import live

    return [live.channel(prefix, crc32(m.encode()) % shards, m) for m in members]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inserts", type=int, default=2000, help="inserts per mode and round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--users", type=int, default=1, help="recipients the inserts spread over")
    parser.add_argument("--others", type=int, default=1000, help="other keys watched")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    parser.add_argument("--pushes", type=int, default=0, help="instead: Redis alone, N calls")
    parser.add_argument("--encode", type=int, default=0, help="instead: the writer's encoding")
    args = parser.parse_args()
    if args.pushes:
        return pushes(args.redis_url, args.pushes, args.rounds, args.others)
    os.environ["COUNTERS_REDIS_URL"] = args.redis_url
    if args.encode:
        return encode(args.encode, args.rounds)

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
    users = [
        get_user_model().objects.get_or_create(username=f"live-cost-{i}")[0].pk
        for i in range(args.users)
    ]
    top = max(users) + 1
    subscriber = Subscriber(
        args.redis_url,
        server,
        channels(buffer.prefix, buffer.shards, (f"unread:{top + i}" for i in range(args.others))),
        channels(buffer.prefix, buffer.shards, (f"unread:{pk}" for pk in users)),
    )
    insert = operations()["tally"]
    set_mode("tally", 0)
    results: dict[str, list[tuple]] = {m: [] for m in MODES}
    for round_ in range(args.rounds):
        for mode in order(round_):
            live.LIVE_COUNTERS.clear()
            if mode != "tally":
                live.LIVE_COUNTERS.add(UNREAD_COUNTER)
            subscriber.start(mode)
            try:
                for i in range(50):  # warm up the mode's code paths and caches
                    insert(users[i % len(users)])
                counters.push_queued()
                before = (time.process_time(), redis_cpu(server), time.perf_counter())
                for i in range(args.inserts):
                    insert(users[i % len(users)])
                counters.push_queued()
                after = (time.process_time(), redis_cpu(server), time.perf_counter())
            finally:
                subscriber.stop()
            results[mode].append(
                tuple((b - a) / args.inserts for a, b in zip(before, after, strict=True))
            )
        counters.flush()
    Notification.objects.filter(recipient__in=users).delete()
    counters.flush()
    report(
        f"one writer, {args.inserts} inserts over {args.users} recipients x {args.rounds} "
        f"rounds, µs per insert (others: {args.others} other keys watched)",
        ["writer", "redis", "wall"],
        results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
