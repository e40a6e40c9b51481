"""Flush buffered counter deltas into the DB once (for cron).

Exit status:

- 0: flushed; one summary line per database (one line when there is one
  database), or the result as JSON.
- 1: failed (Redis or the database cannot be reached, a shard failed, a bad
  argument); one readable line on stderr, and with ``--json`` an object
  with ``"error"`` on stdout (``"redis": "unreachable"`` when Redis is down,
  ``"error reply"`` when it answered with an error such as ``WRONGTYPE``).
- 4 (``REBUILD_NEEDED``): Redis lost buffered deltas and no full rebuild has
  completed since; the summary (or JSON) still goes to stdout, and one line
  naming the fix to stderr.
- 5 (``LAYOUT_NOT_DRAINED``): the buffer layout changed (``COUNTERS_KEY_PREFIX``,
  ``COUNTERS_SHARDS``, ``COUNTERS_REDIS_CLUSTER``) and deltas of another
  layout are not drained yet; the summary still goes to stdout, and one line
  per layout to stderr. Takes precedence over 4: no repair runs until then.

On a terminal a bar on stderr shows the keys applied of the backlog found at the start
(none with ``--json``, nor when stderr is not a terminal).
``--database`` flushes only that alias; without it, every alias of
``counters.client.flushed_databases()``. ``--retry-quarantined`` first puts the deltas
the quarantine holds back into the buffer (a delta that fails again is
quarantined again); ``--discard-quarantined`` drops them for good. Both are
fenced repairs: while a rebuild holds the rebuild lease they change nothing
and the command exits 1.
"""

from __future__ import annotations

import json
import sys
from contextlib import AbstractContextManager, nullcontext

from django.core.management.base import CommandError
from django.db import connections

from counters.base.exceptions import FlushFailed
from counters.client import flushed_databases, get_buffer
from counters.flushing.epoch import REBUILD_COMMAND
from counters.management.commands._failures import OneLineFailures, failure, failure_data
from counters.management.commands._progress import BacklogWatch, Progress
from counters.ops.run import flush, flush_databases

FAILED = 1
REBUILD_NEEDED = 4
LAYOUT_NOT_DRAINED = 5


class Command(OneLineFailures):
    help = "Apply buffered counter deltas from Redis to the counter rows, once (for cron)."

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--time-budget",
            type=float,
            default=None,
            help="Seconds to spend at most (default: COUNTERS_FLUSH_TIME_BUDGET).",
        )
        parser.add_argument(
            "--json",
            action="store_true",
            help="Print the result as JSON (an object per alias when several are flushed).",
        )
        parser.add_argument(
            "--database",
            default=None,
            help="Flush only this database alias (default: every alias of COUNTERS_DATABASES).",
        )
        quarantined = parser.add_mutually_exclusive_group()
        quarantined.add_argument(
            "--retry-quarantined",
            action="store_true",
            help="Put the quarantined deltas back into the buffer first (fix their cause first).",
        )
        quarantined.add_argument(
            "--discard-quarantined",
            action="store_true",
            help="Drop the quarantined deltas for good (the audit repairs from the truth).",
        )

    def watch(self, alias: str | None, as_json: bool) -> AbstractContextManager[object]:
        """On a terminal (and without ``--json``), a bar of the keys applied so far."""
        if as_json or not self.stderr.isatty():
            return nullcontext()
        aliases = [alias] if alias is not None else flushed_databases()
        buffers = list({b.prefix: b for b in map(get_buffer, aliases)}.values())
        return BacklogWatch(buffers, Progress(self.stderr, True, noun="keys applied"))

    def handle(self, *args, **options) -> None:
        budget = options["time_budget"]
        if budget is not None and budget <= 0:
            raise CommandError("--time-budget must be greater than 0")
        alias = options["database"]
        if alias is not None and alias not in connections:
            raise CommandError(f"--database: no database alias {alias!r} in DATABASES")
        quarantined = {
            "retry_quarantined": options["retry_quarantined"],
            "discard_quarantined": options["discard_quarantined"],
        }
        try:
            with self.watch(alias, options["json"]):
                if alias is None:
                    results = flush_databases(time_budget=budget, **quarantined)
                else:
                    results = {alias: flush(using=alias, time_budget=budget, **quarantined)}
        except Exception as exc:
            if options["json"]:
                self.stdout.write(json.dumps(self.failure_data(exc)))
            raise failure("counters_flush", exc) from exc
        if len(results) == 1:  # one database: one line, or one result object
            [result] = results.values()
            self.stdout.write(json.dumps(result.as_dict()) if options["json"] else result.summary())
        elif options["json"]:
            self.stdout.write(json.dumps({name: r.as_dict() for name, r in results.items()}))
        else:
            for name, result in results.items():
                self.stdout.write(f"{name}: {result.summary()}")
        wrong = {
            name: r.rebuild_needed_since for name, r in results.items() if r.rebuild_needed_since
        }
        for name, since in wrong.items():
            where = f"database {name!r}: " if len(results) > 1 else ""
            self.stderr.write(
                f"{where}counts are wrong since {since} (Redis lost buffered deltas) until a "
                f"full rebuild completes: run `{REBUILD_COMMAND}`"
            )
        stranded = {name: r.layouts_pending for name, r in results.items() if r.layouts_pending}
        for name, layouts in stranded.items():
            where = f"database {name!r}: " if len(results) > 1 else ""
            for layout in layouts:
                self.stderr.write(
                    f"{where}deltas of buffer layout {layout} are not drained yet: reads miss "
                    "them and repairs wait (see counters_status)"
                )
        if stranded:
            sys.exit(LAYOUT_NOT_DRAINED)
        if wrong:
            sys.exit(REBUILD_NEEDED)

    @staticmethod
    def failure_data(exc: Exception) -> dict:
        """The JSON printed for a failure: the error, and what is known of the flush."""
        data: dict = failure_data(exc)
        if isinstance(exc, FlushFailed) and hasattr(exc.result, "as_dict"):
            data = {**exc.result.as_dict(), **data}
        return data
