"""Flush buffered counter deltas into the DB once (for cron).

Exit status 0 with one summary line per database (one line when there is one
database); 1 with one readable line when Redis or the database cannot be
reached or a shard failed; 4 (``REBUILD_NEEDED``) when Redis lost buffered
deltas and no full rebuild has completed since: the summary (or JSON) still
goes to stdout, and one line naming the fix to stderr. ``--database`` flushes
only that alias; without it, every alias of ``counters.api.databases()``.
"""

from __future__ import annotations

import json
import sys

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connections

import counters
from counters import api
from counters.epoch import REBUILD_COMMAND
from counters.exceptions import BufferUnavailable, FlushFailed

REBUILD_NEEDED = 4


class Command(BaseCommand):
    help = "Apply buffered unread-count deltas from Redis to the UnreadCounter rows."

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

    def handle(self, *args, **options) -> None:
        budget = options["time_budget"]
        if budget is not None and budget <= 0:
            raise CommandError("--time-budget must be greater than 0")
        alias = options["database"]
        if alias is not None and alias not in connections:
            raise CommandError(f"--database: no database alias {alias!r} in DATABASES")
        try:
            if alias is None:
                results = api.flush_databases(time_budget=budget)
            else:
                results = {alias: counters.flush(using=alias, time_budget=budget)}
        except (BufferUnavailable, FlushFailed) as exc:
            raise CommandError(str(exc)) from exc
        except DatabaseError as exc:
            first_line = (
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            )
            raise CommandError(f"database error: {first_line}") from exc
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
        if wrong:
            sys.exit(REBUILD_NEEDED)
