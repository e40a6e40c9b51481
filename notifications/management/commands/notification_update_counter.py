"""Flush buffered counter deltas into the DB once (for cron).

Exit status 0 with one summary line; 1 with one readable line when Redis or
the database cannot be reached or a shard failed; 4 (``REBUILD_NEEDED``)
when Redis lost buffered deltas and no full rebuild has completed since: the
summary (or JSON) still goes to stdout, and one line naming the fix to stderr.
"""

from __future__ import annotations

import json
import sys

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

import counters
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
        parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
        parser.add_argument("--database", default="default", help="Database alias.")

    def handle(self, *args, **options) -> None:
        budget = options["time_budget"]
        if budget is not None and budget <= 0:
            raise CommandError("--time-budget must be greater than 0")
        try:
            result = counters.flush(using=options["database"], time_budget=budget)
        except (BufferUnavailable, FlushFailed) as exc:
            raise CommandError(str(exc)) from exc
        except DatabaseError as exc:
            first_line = (
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            )
            raise CommandError(f"database error: {first_line}") from exc
        if options["json"]:
            self.stdout.write(json.dumps(result.as_dict()))
        else:
            self.stdout.write(result.summary())
        if result.rebuild_needed_since:
            self.stderr.write(
                f"counts are wrong since {result.rebuild_needed_since} (Redis lost buffered "
                f"deltas) until a full rebuild completes: run `{REBUILD_COMMAND}`"
            )
            sys.exit(REBUILD_NEEDED)
