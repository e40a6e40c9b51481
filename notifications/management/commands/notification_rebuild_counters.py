"""Recompute unread counts from the notifications and repair the wrong counters.

Without ``--dry-run`` or ``--user`` this is the full rebuild: every counter
with a truth source is rebuilt, and once it completes, a Redis data loss
detected before it started no longer marks the counters as needing a rebuild.

Exit status: 0 when nothing was wrong or everything was repaired, 3 when
``--dry-run`` found drift, 1 on errors (one readable line on stderr; the
traceback goes to the ``counters`` log at DEBUG).
"""

from __future__ import annotations

import json
import sys

from django.core.management.base import CommandError
from django.db import DatabaseError

from counters import api, epoch
from counters.exceptions import BufferUnavailable, RebuildRunning
from counters.management.commands._failures import OneLineFailures, failure
from counters.rebuild import RebuildReport, rebuild
from notifications.apps import UNREAD_COUNTER

DRIFT_FOUND = 3


class Progress:
    """A bar on a terminal, a log line every 10% elsewhere."""

    def __init__(self, stream, tty: bool) -> None:
        self.stream = stream
        self.tty = tty
        self.next_step = 0.1

    def __call__(self, done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        if self.tty:
            filled = int(fraction * 30)
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
            self.stream.flush()
        elif fraction >= self.next_step or done == total:
            self.stream.write(f"checked {done}/{total} counters ({fraction:.0%})\n")
            self.stream.flush()
            while self.next_step <= fraction:
                self.next_step += 0.1

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


class Command(OneLineFailures):
    help = (
        "Recompute every unread counter from COUNT(*) of unread notifications and repair "
        "the wrong ones through the normal delta path (safe while writes continue)."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Report, repair nothing.")
        parser.add_argument(
            "--user",
            type=int,
            action="append",
            dest="users",
            metavar="ID",
            help="Only this user id (repeatable).",
        )
        parser.add_argument("--json", action="store_true", help="Print the report as JSON.")
        parser.add_argument("--batch-size", type=int, default=1000, help="Users per page.")
        parser.add_argument("--database", default="default", help="Database alias.")

    def handle(self, *args, **options) -> None:
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        progress = None
        if not options["json"]:
            progress = Progress(self.stderr._out, sys.stderr.isatty())
        using = options["database"]
        full = not options["dry_run"] and options["users"] is None
        others: list[RebuildReport] = []
        try:
            if full:
                needed = epoch.rebuild_needed_since(api.get_buffer().prefix, using)
                reports = api.rebuild_all(
                    using=using, batch_size=options["batch_size"], progress=progress
                )
                report = next(r for r in reports if r.counter == UNREAD_COUNTER)
                others = [r for r in reports if r is not report]
            else:
                report = rebuild(
                    UNREAD_COUNTER,
                    keys=options["users"],
                    dry_run=options["dry_run"],
                    batch_size=options["batch_size"],
                    progress=progress,
                    using=using,
                )
        except RebuildRunning as exc:
            raise CommandError(str(exc)) from exc
        except BufferUnavailable as exc:
            raise CommandError(f"{exc} (a rebuild needs the buffered deltas)") from exc
        except DatabaseError as exc:
            raise failure("notification_rebuild_counters", exc) from exc
        finally:
            if progress is not None:
                progress.close()
        self.report(report, others, options["json"])
        repaired_loss = (
            full and needed and not epoch.rebuild_needed_since(api.get_buffer().prefix, using)
        )
        if repaired_loss and not options["json"]:
            self.stdout.write(f"the Redis data loss seen since {needed.isoformat()} is repaired")
        if options["dry_run"] and report.wrong:
            sys.exit(DRIFT_FOUND)

    def report(self, report: RebuildReport, others: list[RebuildReport], as_json: bool) -> None:
        if as_json:
            data = report.as_dict()
            data["wrong"] = [
                {
                    "user": d["key"],
                    "stored": d["stored"],
                    "pending": d["pending"],
                    "truth": d["truth"],
                }
                for d in data["wrong"]
            ]
            if others:
                data["other_counters"] = [other.as_dict() for other in others]
            self.stdout.write(json.dumps(data, default=str))
            return
        for drift in report.wrong:
            self.stdout.write(
                json.dumps(
                    {
                        "user": drift.key,
                        "stored": drift.stored,
                        "pending": drift.pending,
                        "truth": drift.truth,
                    }
                )
            )
        self.stdout.write(report.summary())
        for other in others:
            self.stdout.write(other.summary())
