"""The instructions one counted insert costs its writer, counted by callgrind, per mode.

A writer's CPU time moves by tens of µs from run to run on a shared machine;
the instructions a process runs do not. This counts them with ``valgrind
--tool=callgrind`` (user space only: the kernel's share of a system call is
not counted) for one writer that inserts notifications, ``--high`` times
and ``--low`` times after 200 to warm up, and prints the difference per
insert::

    DEBUG=0 DATABASE_URL=postgres://postgres@127.0.0.1:5432/tally_bench \\
        python scripts/write_instructions.py --modes off,floor_push,tally \\
        --redis-url redis://127.0.0.1:6393/0

- The INSERT itself is stubbed (``Model._do_insert`` returns a new id), so
  neither the database nor its driver is counted: what is left is Django's
  ``create()`` and what each mode adds to it.
- Redis is real: each push is written and its reply read as always.
- ``ACK_AFTER`` is raised, so the replies are read once 16 pushes wait, as
  a busy writer reads them, and not when the acknowledging thread happens
  to wake under valgrind (which moves the count by thousands of
  instructions from run to run).
- The garbage collector is frozen and ``PYTHONHASHSEED`` is 0. Two runs of
  the same code agree within about 1,000 instructions.

The modes are those of ``scripts/write_cost.py`` (``counters_bench``'s). Run
each tree of an A/B from its own directory: Celery's Django fixup puts the
current directory first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARM_UP = 200


def run(mode: str, inserts: int) -> int:
    """Inside callgrind: ``inserts`` inserts of ``mode`` after the warm-up."""
    import gc

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.db import connection
    from django.db.models import Model

    import counters
    from benchmarks.internals import acks
    from benchmarks.writers import Floor, operations, set_mode

    ids = itertools.count(10**12)

    def stubbed_insert(self, manager, using, fields, returning_fields, raw):
        return [(next(ids),)]

    Model._do_insert = stubbed_insert  # type: ignore[method-assign]
    acks.ACK_AFTER = 1e9
    connection.ensure_connection()
    set_mode(mode, 0)
    op = operations()[mode]
    if isinstance(op, Floor):
        op.begin()
    for _ in range(WARM_UP):
        op(1)
    gc.collect()
    gc.freeze()
    gc.disable()
    for _ in range(inserts):
        op(1)
    counters.push_queued()
    if isinstance(op, Floor):
        op.finish()
    return 0


def count(mode: str, inserts: int, redis_url: str) -> int:
    """The instructions of a whole run of ``inserts`` inserts of ``mode``."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "COUNTERS_REDIS_URL": redis_url}
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--run",
        mode,
        "--inserts",
        str(inserts),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{mode}: callgrind failed: {done.stderr.strip().splitlines()[-1:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="off,floor_push,tally")
    parser.add_argument("--low", type=int, default=300, help="inserts of the shorter run")
    parser.add_argument("--high", type=int, default=1300, help="inserts of the longer run")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    parser.add_argument("--run", metavar="MODE", help=argparse.SUPPRESS)
    parser.add_argument("--inserts", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        return run(args.run, args.inserts)
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind (apt-get install valgrind)")
    if args.high <= args.low:
        parser.error("--high must be above --low")
    print(f"instructions per insert, the INSERT stubbed ({args.high} - {args.low} inserts)")
    per: dict[str, int] = {}
    for mode in args.modes.split(","):
        spent = count(mode, args.high, args.redis_url) - count(mode, args.low, args.redis_url)
        per[mode] = spent // (args.high - args.low)
        over = f"{per[mode] - per['off']:+,}" if "off" in per and mode != "off" else ""
        print(f"{mode:<14} {per[mode]:>10,} {over:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
