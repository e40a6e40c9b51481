"""Recompute counters from their truth and repair the wrong ones through the delta path.

``manage.py counters_rebuild [NAME ...] [--dry-run] [--json] [--key K ...] [--database X]``

Without NAME, every counter that has a truth source (every ``counters.track()``
counter has one). Without NAME, ``--dry-run`` and ``--key`` this is the full
rebuild: once it completes, a Redis data loss detected before it started no
longer marks the counters as needing a rebuild. ``--user`` is an alias of
``--key``. Safe while writers and flushers run: a difference is repaired
only once it was seen the same in several readings in a row.

Prints one JSON line per wrong counter (``counter``, ``key``, ``stored``,
``pending``, ``truth``) and one summary line per counter, or with ``--json``
one object. Progress goes to stderr. Exit status: 0 when nothing was wrong or
everything was repaired, 3 when ``--dry-run`` found drift, 1 on errors (one
readable line on stderr; with ``--json`` also an object with ``error``, and
``redis``: ``unreachable`` or ``error reply`` when Redis failed, on stdout).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from redis import RedisError

from counters.base import conf
from counters.base.exceptions import (
    BufferUnavailable,
    CountersError,
    RebuildRunning,
    UnknownCounter,
)
from counters.base.registry import all_specs, get_spec
from counters.client import get_buffer
from counters.flushing import epoch
from counters.flushing.fence import Fence
from counters.management.commands._failures import OneLineFailures, failure, failure_data
from counters.management.commands._progress import Progress
from counters.verify.hold import rebuild_lease, wait_for_audit
from counters.verify.rebuild import RebuildReport, rebuild, rebuild_all

DRIFT_FOUND = 3


class Command(OneLineFailures):
    help = (
        "Recompute counters (every one with a truth source, or the NAMEs given) from their "
        "source rows and repair the wrong ones through the normal delta path (safe while "
        "writes continue)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("names", nargs="*", metavar="NAME", help="Counters to rebuild.")
        parser.add_argument(
            "--key",
            "--user",
            action="append",
            dest="keys",
            metavar="K",
            help="Only this key (repeatable); --user is an alias.",
        )
        self.add_common_arguments(parser)

    def add_common_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Report, repair nothing.")
        parser.add_argument("--json", action="store_true", help="Print the report as JSON.")
        parser.add_argument("--batch-size", type=int, default=1000, help="Keys per page.")
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, help="Database alias.")

    def counter_names(self, options: dict[str, Any]) -> list[str]:
        """The counters to rebuild, each checked to exist and to have a truth source."""
        names = list(dict.fromkeys(options["names"]))
        if not names:
            return [spec.name for spec in all_specs() if spec.source is not None]
        for name in names:
            try:
                spec = get_spec(name)
            except UnknownCounter:
                known = ", ".join(sorted(s.name for s in all_specs())) or "none"
                raise CommandError(f"no counter named {name!r} (known: {known})") from None
            if spec.source is None:
                raise CommandError(f"counter {name!r} has no truth source; it cannot be rebuilt")
        return names

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the rebuild; with ``--json`` a failure still prints one object with ``error``."""
        try:
            self.run(options)
        except Exception as exc:
            if options["json"]:
                self.stdout.write(json.dumps(self.failure_data(exc)))
            raise

    @staticmethod
    def failure_data(exc: Exception) -> dict[str, Any]:
        """``error`` (the line printed on stderr too) and ``redis`` when Redis failed."""
        cause = exc.__cause__ if isinstance(exc, CommandError) and exc.__cause__ else exc
        data = failure_data(cause)
        data["error"] = str(exc) if isinstance(exc, CommandError) else data["error"]
        return data

    def run(self, options: dict[str, Any]) -> None:
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        using = options["database"]
        if using not in connections:
            raise CommandError(f"--database: no database alias {using!r} in DATABASES")
        names = self.counter_names(options)
        keys = options["keys"]
        full = not options["dry_run"] and keys is None and not options.get("names")
        progress = None if options["json"] else Progress(self.stderr, sys.stderr.isatty())
        needed = None
        try:
            if full:
                needed = epoch.rebuild_needed_since(get_buffer(using).prefix, using)
                reports = rebuild_all(
                    using=using, batch_size=options["batch_size"], progress=progress
                )
            else:
                reports = self.rebuild_some(names, keys, options, progress, using)
        except RebuildRunning as exc:
            raise CommandError(str(exc)) from exc
        except BufferUnavailable as exc:
            raise CommandError(f"{exc} (a rebuild needs the buffered deltas)") from exc
        except (CountersError, ValueError) as exc:  # an invalid --key
            raise CommandError(str(exc)) from exc
        except DatabaseError as exc:
            raise failure("counters_rebuild", exc) from exc
        finally:
            if progress is not None:
                progress.close()
        self.report(reports, options["json"])
        prefix = get_buffer(using).prefix
        repaired = full and needed and not epoch.rebuild_needed_since(prefix, using)
        if repaired and needed is not None and not options["json"]:
            self.stdout.write(f"the Redis data loss seen since {needed.isoformat()} is repaired")
        if options["dry_run"] and any(r.wrong for r in reports):
            sys.exit(DRIFT_FOUND)

    def rebuild_some(
        self,
        names: list[str],
        keys: list[str] | None,
        options: dict[str, Any],
        progress: Progress | None,
        using: str,
    ) -> list[RebuildReport]:
        """Rebuild ``names`` (or only ``keys`` of them); a repair holds the rebuild lease,
        so that it never overlaps a full rebuild or an audit that could repair the same key."""

        def run(
            page_done: Callable[[int, int], None] | None, fence: Fence | None = None
        ) -> list[RebuildReport]:
            return [
                rebuild(
                    name,
                    keys=keys,
                    dry_run=options["dry_run"],
                    batch_size=options["batch_size"],
                    progress=page_done,
                    using=using,
                    fence=fence,
                )
                for name in names
            ]

        if options["dry_run"]:
            return run(progress)
        buffer = get_buffer(using)
        try:
            with rebuild_lease(buffer, using) as lease:
                if not lease.held and not wait_for_audit(buffer, lease):
                    raise RebuildRunning(lease.key)

                def page_done(done: int, total: int) -> None:
                    lease.extend()
                    if progress is not None:
                        progress(done, total)

                return run(page_done, lease.fence)
        except RedisError as exc:
            raise BufferUnavailable(conf.redis_where(), exc) from exc

    def report(self, reports: list[RebuildReport], as_json: bool) -> None:
        if as_json:
            data = {"counters": [r.as_dict() for r in reports]}
            self.stdout.write(json.dumps(data, default=str))
            return
        for report in reports:
            for drift in report.wrong:
                line = {"counter": report.counter, "key": drift.key}
                line.update(stored=drift.stored, pending=drift.pending, truth=drift.truth)
                self.stdout.write(json.dumps(line, default=str))
        for report in reports:
            self.stdout.write(report.summary())
