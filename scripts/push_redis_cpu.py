"""What a push costs Redis: its CPU per command, against ``INCR`` and an empty script.

One client sends each command and waits for its reply (one round trip per
command, as a writer's push is sent), ``--calls`` times per mode, in
``--rounds`` interleaved rounds. Per mode, the median of Redis's own CPU time
per call (``used_cpu_user + used_cpu_sys`` of ``INFO cpu``, before and after)
and of the wall time per call seen by the client:

- ``incr``: ``INCR <key>`` (the ``floor`` mode of ``counters_bench``);
- ``evalsha_noop``: ``EVALSHA`` of a script that returns 1, with the keys and
  arguments of a one-member push (the same bytes on the wire);
- ``evalsha_push``: the push script itself (``counters/buffer/lua/push.lua``),
  a new sequence number each time, members spread over 5000 keys.

Its keys are under ``push-redis-cpu:`` and are deleted at the end. Run it
against a Redis that nothing else uses, on a quiet machine::

    redis-server --port 6393 --save '' --appendonly no --bind 127.0.0.1 &
    python scripts/push_redis_cpu.py --redis-url redis://127.0.0.1:6393/0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "push-redis-cpu"
#: The push script's fixed arguments: the writer hash's lifetime and the most a push may age (ms).
TTL_MS, MAX_AGE_MS = 60_000, 600_000


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def timed(client: redis.Redis, calls: int, send: Callable[[int], object]) -> tuple[float, float]:
    """(Redis CPU µs, wall µs) per call of ``send(i)`` for i in ``range(calls)``."""
    cpu, started = redis_cpu(client), time.perf_counter()
    for i in range(calls):
        send(i)
    wall = time.perf_counter() - started
    return (redis_cpu(client) - cpu) / calls * 1e6, wall / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000, help="commands per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds are at least 1")
    client = redis.Redis.from_url(args.redis_url)
    try:
        client.ping()
    except redis.RedisError as exc:
        print(f"Redis unreachable at {args.redis_url}: {exc}", file=sys.stderr)
        return 1
    push = client.script_load((ROOT / "counters/buffer/lua/push.lua").read_text())
    noop = client.script_load("return 1")
    keys = tuple(f"{PREFIX}:{{s0}}:{name}" for name in ("pending", "w:bench", "since", "suspects"))
    seq = 0

    def push_args(i: int) -> tuple:
        nonlocal seq
        seq += 1
        return (*keys, TTL_MS, int(time.time() * 1000), MAX_AGE_MS, seq, f"unread:{i % 5000}", 1)

    modes: dict[str, Callable[[int], object]] = {
        "incr": lambda i: client.incr(f"{PREFIX}:incr"),
        "evalsha_noop": lambda i: client.evalsha(noop, 4, *push_args(i)),
        "evalsha_push": lambda i: client.evalsha(push, 4, *push_args(i)),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    try:
        for r in range(args.rounds):
            names = list(modes)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                results[name].append(timed(client, args.calls, modes[name]))
    finally:
        client.delete(*keys, f"{PREFIX}:incr")
    print(f"{'mode':<14} {'Redis CPU µs':>13} {'wall µs':>9}")
    for name, runs in results.items():
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        print(f"{name:<14} {cpu:>13.1f} {wall:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
