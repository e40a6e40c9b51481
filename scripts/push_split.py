"""Where one writer's CPU above the floor goes: Tally's counted save, its command, or the rest.

One writer process inserts notifications for one user, ``--rounds`` rounds of
``--inserts`` per mode, the modes in rotating order, and prints per mode the
median over the rounds of its CPU per insert (``time.process_time``) over
``off``'s in the same round, and over ``floor_push``'s in the same round.
Paired so, a round's load moves both sides of each difference::

    DEBUG=0 DATABASE_URL=postgres://postgres@127.0.0.1:5432/tally_bench \\
        python scripts/push_split.py --redis-url redis://127.0.0.1:6393/0

The modes:

- ``off``, ``floor_push``, ``tally``: those of ``scripts/write_cost.py``;
- ``save_floor``: ``tally`` with each push after the COMMIT made by the floor's
  own push (:meth:`benchmarks.writers.PushFloor.push`: its command, one write,
  the replies read 50 at a time and counted). What it adds to ``floor_push``
  is Tally's counted save and its hand-off from the COMMIT, against the
  floor's ``post_save`` receiver;
- ``command_socket``: ``tally`` with each push made of Tally's own command (the
  next number of a writer of the thread's line, ``Intake.wire_one()``),
  written on a connection made as the line's, the replies read as the floor
  reads them: no record kept for the reply, no reply checked. What it adds to
  ``save_floor`` is Tally's command; what ``tally`` adds to it, the record,
  the line's write and the reading of the replies.

Only for one-member pushes (the unread counter); Redis must be plain Redis over
TCP, as for the floor modes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("off", "floor_push", "tally", "save_floor", "command_socket")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inserts", type=int, default=1000, help="inserts per mode and round")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    args = parser.parse_args()
    if args.inserts < 1 or args.rounds < 1:
        parser.error("--inserts and --rounds must be at least 1")

    os.environ["COUNTERS_REDIS_URL"] = args.redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.contrib.auth import get_user_model

    import counters
    from benchmarks.errors import BenchError
    from benchmarks.internals import Line, pushids, replies
    from benchmarks.writers import Floor, PushFloor, drop_floor_keys, operations, set_mode
    from notifications.models import Notification

    user, _ = get_user_model().objects.get_or_create(username="write-cost")
    ops = operations()
    floor = PushFloor(ops["off"])
    try:
        floor.connect()
    except BenchError as exc:
        parser.error(str(exc))
    buffer = counters.get_buffer()
    line = Line(buffer)  # a connection made as a thread's line makes its own
    sock = line._open()
    sock.settimeout(None)  # read as the floor reads: blocking, 50 replies at a time
    unread = 0

    def read_replies() -> None:
        nonlocal unread
        seen = 0
        while seen < unread:
            chunk = sock.recv(65536)
            if not chunk:
                raise SystemExit("Redis closed the connection")
            seen += chunk.count(b"\n")
        unread = 0

    def floor_push(self: Any, deltas: Mapping[str, int], complete: Any, batch: int) -> list:
        floor.push(dict(deltas))
        return []  # sent, none failed

    def command_socket(self: Any, deltas: Mapping[str, int], complete: Any, batch: int) -> list:
        nonlocal unread
        ((member, delta),) = deltas.items()
        with self.lock:
            writers = self.writers
            writer = writers.pop() if writers else pushids.Writer()
            seq = writer.seq + 1
            wire = self.buffer.wire_one(member, delta, writer.id, seq)
            if wire is None:
                raise SystemExit(f"no one-member command for {member!r} {delta!r}")
            writer.seq = seq
            sock.sendall(wire)
            unread += 1
            if unread >= Floor.WINDOW:
                read_replies()
            writers.append(writer)
        return []  # sent, none failed

    pushes: dict[str, Callable[..., list]] = {
        "save_floor": floor_push,
        "command_socket": command_socket,
    }

    @contextmanager
    def pushing(mode: str) -> Iterator[None]:
        """Within it, a ``tally`` push of the thread goes the mode's way."""
        hand_on = replies.Acks.hand_on
        if mode in pushes:
            replies.Acks.hand_on = pushes[mode]  # type: ignore[method-assign]
        try:
            yield
        finally:
            replies.Acks.hand_on = hand_on  # type: ignore[method-assign]

    spent: dict[str, list[float]] = {m: [] for m in MODES}
    for round_ in range(args.rounds):
        for mode in MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]:
            set_mode("tally" if mode in pushes else mode, 0)
            op = ops["tally" if mode in pushes else mode]
            with pushing(mode):
                if isinstance(op, Floor):
                    op.begin()
                for _ in range(30):  # warm up the mode's code paths and caches
                    op(user.pk)
                counters.push_queued()
                before = time.process_time()
                for _ in range(args.inserts):
                    op(user.pk)
                counters.push_queued()
                if isinstance(op, Floor):
                    op.finish()  # its replies still unread, read in its time as Tally's are
                read_replies()
                floor.finish()
                after = time.process_time()
            spent[mode].append((after - before) / args.inserts * 1e6)
        if round_ % 10 == 9:
            counters.flush()
    set_mode("tally", 0)
    Notification.objects.filter(recipient=user).delete()
    counters.flush()
    line.close()
    floor.close()
    drop_floor_keys(counters.get_client(), buffer.prefix)

    def paired(mode: str, base: str) -> str:
        pairs = zip(spent[mode], spent[base], strict=True)
        return f"{statistics.median(a - b for a, b in pairs):+.1f}"

    print(f"one writer, {args.inserts} inserts x {args.rounds} rounds, CPU µs per insert")
    print("{:<15} {:>7} {:>9} {:>15}".format("mode", "median", "over off", "over floor_push"))
    for mode in MODES:
        median = f"{statistics.median(spent[mode]):.1f}"
        row = (mode, median, paired(mode, "off"), paired(mode, "floor_push"))
        print("{:<15} {:>7} {:>9} {:>15}".format(*row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
