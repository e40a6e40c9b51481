"""Run the continuous audit once (for cron): the next slice of keys of each counter.

``manage.py counters_audit [NAME ...] [--slice N] [--json] [--database X]``

Without NAME, every counter that has a truth source. Each run checks the
next ``--slice`` keys (default ``COUNTERS_AUDIT_SLICE``) of each counter
after its cursor, compares stored + buffered with the truth, and repairs a
difference seen the same on several readings in a row through the delta
path; see :mod:`counters.verify.audit`. Safe while writers and flushers run; it
does nothing when a rebuild or another audit of the same database runs.

Prints one JSON line per repair (``counter``, ``key``, ``stored``,
``buffered``, ``truth``) and one summary line per database, or with
``--json`` one object (an object per alias when several are audited).
On a terminal a bar on stderr shows the keys checked (none with ``--json``).
Exit status: 0 when the run completed (repairs included) or was skipped
because a rebuild or another audit runs; 1 on errors (Redis or the
database unreachable, a bad argument): one readable line on stderr, and
with ``--json`` ``{"error": …}`` on stdout.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import connections

from counters.base.exceptions import UnknownCounter
from counters.client import flushed_databases
from counters.management.commands._failures import OneLineFailures, failure, failure_data
from counters.management.commands._progress import Progress
from counters.verify.audit import AuditResult, audit, audited_specs
from counters.verify.drift import NoTruthSource


class Command(OneLineFailures):
    help = (
        "Compare the next slice of keys of every counter (or the NAMEs given) with their "
        "truth and repair confirmed drift through the delta path, once (for cron)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("names", nargs="*", metavar="NAME", help="Counters to audit.")
        parser.add_argument(
            "--slice",
            type=int,
            default=None,
            help="Keys of each counter to check (default: COUNTERS_AUDIT_SLICE).",
        )
        parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
        parser.add_argument(
            "--database",
            default=None,
            help="Audit only this database alias (default: every alias of COUNTERS_DATABASES).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        size = options["slice"]
        if size is not None and size < 1:
            raise CommandError("--slice must be at least 1")
        alias = options["database"]
        if alias is not None and alias not in connections:
            raise CommandError(f"--database: no database alias {alias!r} in DATABASES")
        names = list(dict.fromkeys(options["names"])) or None
        try:
            audited_specs(names)
        except UnknownCounter as exc:
            raise CommandError(str(exc)) from None
        except NoTruthSource as exc:
            raise CommandError(f"{exc}; it cannot be audited") from None
        aliases = [alias] if alias is not None else flushed_databases()
        results: dict[str, AuditResult] = {}
        tty = not options["json"] and self.stderr.isatty()
        try:
            for name in aliases:
                progress = Progress(self.stderr, tty, noun="keys", lines=False)
                try:
                    results[name] = audit(name, names=names, slice_size=size, progress=progress)
                finally:
                    progress.close()
        except Exception as exc:
            if options["json"]:
                self.stdout.write(json.dumps(failure_data(exc)))
            raise failure("counters_audit", exc) from exc
        self.report(results, options["json"])

    def report(self, results: dict[str, AuditResult], as_json: bool) -> None:
        if as_json:
            if len(results) == 1:
                [result] = results.values()
                self.stdout.write(json.dumps(result.as_dict(), default=str))
            else:
                data = {name: r.as_dict() for name, r in results.items()}
                self.stdout.write(json.dumps(data, default=str))
            return
        for name, result in results.items():
            for counter in result.counters:
                for drift in counter.repaired:
                    line = {"counter": counter.counter, "key": drift.key}
                    line.update(stored=drift.stored, buffered=drift.pending, truth=drift.truth)
                    if len(results) > 1:
                        line["database"] = name
                    self.stdout.write(json.dumps(line, default=str))
        for name, result in results.items():
            where = f"{name}: " if len(results) > 1 else ""
            self.stdout.write(f"{where}{result.summary()}")
