"""What one push costs the committing thread, layer by layer, without the insert.

One process sends ``--pushes`` pushes of one member (``unread:1``, +1) per
mode, in ``--rounds`` interleaved rounds, and reports the median of its CPU
time per push (``time.process_time``, every thread of the process). Each
mode adds one layer of Tally's write path to the one before:

- ``floor_push``: :meth:`benchmarks.writers.PushFloor.push`, the least a push
  with Tally's guarantees sends (its command encoded from a fixed start, the
  replies read 50 at a time);
- ``plan``: :meth:`~counters.buffer.store.Buffer.plan_push` under a new push
  id, nothing sent;
- ``line``: ``plan``, then the push written by a
  :class:`~counters.buffer.line.Line`, the replies read 16 at a time;
- ``acks``: :meth:`counters.write.replies.Acks.push`, which adds its writers, the
  pushes waiting and the rule of when their replies are read;
- ``send``: :func:`counters.write.delivery.send`, what a commit calls (the
  buffer, its layout recorded, the settings).

So ``send - floor_push`` is what Tally's push adds to its floor, and the
modes between say where::

    redis-server --port 6393 --save '' --appendonly no --bind 127.0.0.1 &
    DEBUG=0 DATABASE_URL=postgres://postgres@127.0.0.1:5432/tally_bench \\
        python scripts/push_cost.py --redis-url redis://127.0.0.1:6393/0

Redis answers on the other CPU while the pushes are written, so a push costs
more here than between inserts; compare the modes of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEMBER = "unread:1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=20000, help="pushes per mode and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    args = parser.parse_args()

    os.environ["COUNTERS_REDIS_URL"] = args.redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.db import connection

    import counters
    from benchmarks.internals import Line, delivery, pushids, replies
    from benchmarks.writers import PushFloor, drop_floor_keys

    connection.ensure_connection()
    buffer = counters.get_buffer()
    floor = PushFloor(lambda uid: None)
    floor.connect()
    line = Line(buffer)
    writer = pushids.Writer()
    line_acks = replies.Acks(buffer, "default", replies.ThreadLines())
    n = args.pushes

    def floor_push() -> None:
        for _ in range(n):
            floor.push({MEMBER: 1})
        floor.read_replies()

    def plan() -> None:
        for _ in range(n):
            buffer.plan_push({MEMBER: 1}, writer.next_push_id())

    def through_line() -> None:
        for _ in range(n):
            line.send(buffer.plan_push({MEMBER: 1}, writer.next_push_id()))
            if len(line.unread) >= replies.MAX_WAITING:
                while line.unread:
                    line.receive()
        while line.unread:
            line.receive()

    def through_acks() -> None:
        for _ in range(n):
            if line_acks.push({MEMBER: 1}, delivery.complete):
                raise SystemExit("a push failed: is Redis at --redis-url?")
        if line_acks.settle():
            raise SystemExit("a push failed: is Redis at --redis-url?")

    def send() -> None:
        for _ in range(n):
            delivery.send({MEMBER: 1}, "default")
        counters.push_queued()

    modes: dict[str, Callable[[], None]] = {
        "floor_push": floor_push,
        "plan": plan,
        "line": through_line,
        "acks": through_acks,
        "send": send,
    }
    names = list(modes)
    spent: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            before = time.process_time()
            modes[name]()
            spent[name].append((time.process_time() - before) / n * 1e6)
    floor.close()
    line.close()
    line_acks.line.close()
    counters.flush()
    drop_floor_keys(counters.get_client(), buffer.prefix)

    print(f"{n} pushes of one member x {args.rounds} rounds, CPU µs per push (median)")
    for name in names:
        rounds = " ".join(f"{v:.1f}" for v in spent[name])
        print(f"{name:<11} {statistics.median(spent[name]):6.1f}   {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
