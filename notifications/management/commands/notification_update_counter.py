"""Flush buffered counter deltas into the DB once (for cron).

Exit status 0 with one summary line; non-zero with one readable line when
Redis or the database cannot be reached.
"""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

import counters
from counters.exceptions import BufferUnavailable, FlushFailed


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
