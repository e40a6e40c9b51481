"""Flush buffered counter deltas into the DB once (for cron): ``counters_flush`` by its
project name. Same options, output and exit status (0 ok, 1 one-line failure,
4 rebuild needed); see ``counters/management/commands/counters_flush.py``.

Django's way to offer another app's command under a new name is a command
that imports that command's ``Command`` from ``<app>.management.commands``.
"""

from __future__ import annotations

from counters.management.commands.counters_flush import REBUILD_NEEDED
from counters.management.commands.counters_flush import Command as FlushCommand

__all__ = ["REBUILD_NEEDED", "Command"]


class Command(FlushCommand):
    help = "Apply buffered unread-count deltas to the UnreadCounter rows (see counters_flush)."
