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

With ``--cold MB``, the writer copies ``MB`` megabytes before each insert,
which empties its caches as the other processes of a busy machine do, and
callgrind simulates the caches (``--I1=32768,8,64 --D1=49152,12,64``, a last
level of ``--ll-kb``, 2,048 KiB by default). Each insert then starts cold,
and the script prints beside its instructions the last-level misses it
makes: the cache lines of code (``ILmr``) and of data (read ``DLmr``,
written ``DLmw``) it must bring back from a shared cache or from memory, 20
to 100 ns each, and their sum (``LL``). The copy's own instructions and
misses are the same in every mode: compare modes over ``off``, not the
totals. Two runs of the same code agree within about 60 lines.

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


def run(mode: str, inserts: int, cold_mb: int) -> int:
    """Inside callgrind: ``inserts`` inserts of ``mode`` after the warm-up, each after a
    copy of ``cold_mb`` megabytes (none: 0)."""
    import gc

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.db import connection
    from django.db.models import Model

    import counters
    from benchmarks.internals import replies
    from benchmarks.writers import Floor, operations, set_mode

    ids = itertools.count(10**12)

    def stubbed_insert(self, manager, using, fields, returning_fields, raw):
        return [(next(ids),)]

    Model._do_insert = stubbed_insert  # type: ignore[method-assign]
    replies.ACK_AFTER = 1e9
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
    if cold_mb:
        scratch, zeros = bytearray(cold_mb << 20), bytes(cold_mb << 20)
        for _ in range(inserts):
            scratch[:] = zeros  # empties the caches (the simulated ones: a full copy)
            op(1)
    else:
        for _ in range(inserts):
            op(1)
    counters.push_queued()
    if isinstance(op, Floor):
        op.finish()
    return 0


#: The events callgrind counts with ``--cache-sim=yes``, in its order, and those printed.
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")
MISSES = ("ILmr", "DLmr", "DLmw")


def count(mode: str, inserts: int, redis_url: str, cold_mb: int, ll_kb: int) -> dict[str, int]:
    """The events of a whole run of ``inserts`` inserts of ``mode``: instructions (``Ir``),
    and with ``cold_mb`` the simulated caches' reads, writes and misses."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "COUNTERS_REDIS_URL": redis_url}
    caches = ["--cache-sim=yes", "--I1=32768,8,64", "--D1=49152,12,64", f"--LL={ll_kb << 10},16,64"]
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        *(caches if cold_mb else []),
        sys.executable,
        __file__,
        "--run",
        mode,
        "--inserts",
        str(inserts),
        "--cold",
        str(cold_mb),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    found = re.search(r"Collected : ([\d ]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{mode}: callgrind failed: {done.stderr.strip().splitlines()[-1:]}")
    return dict(zip(EVENTS, map(int, found.group(1).split()), strict=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="off,floor_push,tally")
    parser.add_argument("--low", type=int, default=300, help="inserts of the shorter run")
    parser.add_argument("--high", type=int, default=1300, help="inserts of the longer run")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    parser.add_argument(
        "--cold",
        type=int,
        default=0,
        metavar="MB",
        help="copy MB megabytes before each insert and count the last-level cache misses",
    )
    parser.add_argument("--ll-kb", type=int, default=2048, help="last-level cache of --cold, KiB")
    parser.add_argument("--run", metavar="MODE", help=argparse.SUPPRESS)
    parser.add_argument("--inserts", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        return run(args.run, args.inserts, args.cold)
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind (apt-get install valgrind)")
    if args.high <= args.low:
        parser.error("--high must be above --low")
    if args.cold and args.cold << 10 <= args.ll_kb:
        parser.error("--cold must copy more than the last level holds (--ll-kb)")
    shown = ("Ir", *MISSES, "LL") if args.cold else ("Ir",)
    cold = f", {args.cold} MB copied before each, LL {args.ll_kb} KiB" if args.cold else ""
    print(f"per insert, the INSERT stubbed ({args.high} - {args.low} inserts{cold})")
    print(f"{'mode':<14}" + "".join(f" {name:>10} {'over off':>9}" for name in shown))
    per: dict[str, dict[str, int]] = {}
    for mode in args.modes.split(","):
        high = count(mode, args.high, args.redis_url, args.cold, args.ll_kb)
        low = count(mode, args.low, args.redis_url, args.cold, args.ll_kb)
        per[mode] = {e: (high[e] - low[e]) // (args.high - args.low) for e in shown if e in high}
        if args.cold:
            per[mode]["LL"] = sum(per[mode][e] for e in MISSES)  # all the lines fetched
        row = f"{mode:<14}"
        for name in shown:
            over = per[mode][name] - per["off"][name] if "off" in per and mode != "off" else None
            row += f" {per[mode][name]:>10,} {'' if over is None else f'{over:+,}':>9}"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
