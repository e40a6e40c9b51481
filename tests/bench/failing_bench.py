"""``counters_bench`` with its writer killed in the middle of the first ``trigger`` run.

Run as ``python -m tests.bench.failing_bench`` with the environment of
:func:`tests.procs.project_env`. It runs the quick writes with one writer; when
the first ``trigger`` run starts it prints how many bench triggers the table
has (the run's own: 1), and halfway through the run it kills the writer with
SIGKILL (a fault injected by wrapping ``WriterPool.run``). The bench must end
with one ``CommandError`` line and a non-zero status, and drop its trigger.
"""

from __future__ import annotations

import os
import sys
import threading

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django

django.setup()

from django.core.management import CommandError, call_command  # noqa: E402
from django.db import connection  # noqa: E402

from benchmarks import trigger, writers  # noqa: E402

original = writers.WriterPool.run


def bench_triggers() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_trigger WHERE tgname LIKE %s", [trigger.NAME_PATTERN]
        )
        return int(cursor.fetchone()[0])


def run(
    self: writers.WriterPool, mode: str, workload: str, seconds: float, record: bool = True
) -> writers.Totals:
    if mode == "trigger":
        print(f"bench triggers when the trigger run starts: {bench_triggers()}", flush=True)
        threading.Timer(writers.START_DELAY + seconds / 2, self.procs[0].kill).start()
    return original(self, mode, workload, seconds, record)


def main() -> int:
    writers.WriterPool.run = run  # type: ignore[method-assign]
    try:
        call_command(
            "counters_bench", "--quick", "--sections", "writes", "--processes", "1", "--json"
        )
    except CommandError as exc:
        print(f"CommandError: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
