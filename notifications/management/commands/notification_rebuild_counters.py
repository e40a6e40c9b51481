"""Recompute unread counts from the notifications and repair the wrong counters.

An alias of ``manage.py counters_rebuild unread`` with ``--user ID`` for
``--key``, printing users: one JSON line ``{"user", "stored", "pending",
"truth"}`` per wrong counter, then the summary. Without ``--dry-run`` or
``--user`` this is the full rebuild of every counter (their summaries follow).

Exit status: 0 when nothing was wrong or everything was repaired, 3 when
``--dry-run`` found drift, 1 on errors (one readable line). It extends the
``counters_rebuild`` command, imported from ``counters.management.commands``
(where Django finds it), so both share every option, check and exit status.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandParser

from counters.management.commands import counters_rebuild
from notifications.apps import UNREAD_COUNTER

DRIFT_FOUND = counters_rebuild.DRIFT_FOUND


def _user_row(drift: dict[str, Any]) -> dict[str, Any]:
    return {
        "user": drift["key"],
        "stored": drift["stored"],
        "pending": drift["pending"],
        "truth": drift["truth"],
    }


class Command(counters_rebuild.Command):
    help = (
        "Recompute every unread counter from COUNT(*) of unread notifications and repair "
        "the wrong ones through the normal delta path (safe while writes continue)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--user",
            type=int,
            action="append",
            dest="keys",
            metavar="ID",
            help="Only this user id (repeatable).",
        )
        self.add_common_arguments(parser)

    def counter_names(self, options: dict[str, Any]) -> list[str]:
        return [UNREAD_COUNTER]

    def report(self, reports: list[counters_rebuild.RebuildReport], as_json: bool) -> None:
        report = next(r for r in reports if r.counter == UNREAD_COUNTER)
        others = [r for r in reports if r is not report]
        if as_json:
            data = report.as_dict()
            data["wrong"] = [_user_row(d) for d in data["wrong"]]
            if others:
                data["other_counters"] = [other.as_dict() for other in others]
            self.stdout.write(json.dumps(data, default=str))
            return
        for drift in report.as_dict()["wrong"]:
            self.stdout.write(json.dumps(_user_row(drift), default=str))
        self.stdout.write(report.summary())
        for other in others:
            self.stdout.write(other.summary())
