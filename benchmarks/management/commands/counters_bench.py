"""Measure the unread counter: writes (off / naive / trigger / tally), flush, reads and memory.

Prints a table, or ``--json``; exits non-zero with one readable line on bad
arguments or when Redis or the database cannot be reached.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError
from redis import RedisError

import counters
from benchmarks.config import SECTIONS, BenchConfig
from benchmarks.internals import first_line
from benchmarks.writers import DEFAULT_MODES, MODES


class Command(BaseCommand):
    help = (
        "Benchmark notification writes with no counter, a naive counter, a PostgreSQL trigger "
        "and Tally (its counter live, watched or not, with --modes), with the writer CPU, "
        "backend CPU, WAL and Redis CPU of each insert and "
        "each mode's merged-push setting; "
        "the flush against raw SQL; the flush with 1, 2 and 4 flushers; get_count against "
        "COUNT(*); the flusher's memory; the Redis memory of idempotency, old scheme against new."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--quick", action="store_true", help="Small sizes (CI).")
        parser.add_argument("--json", action="store_true", help="Print the results as JSON.")
        parser.add_argument(
            "--processes",
            default=None,
            help="Writer processes (default 8), or comma-separated counts (2,4,8): the writes "
            "are measured at each, in one run, and shown in one table.",
        )
        parser.add_argument(
            "--seconds", type=float, default=None, help="Length of one measured write run."
        )
        parser.add_argument(
            "--rounds", type=int, default=None, help="Interleaved rounds of the writes."
        )
        parser.add_argument(
            "--send-delay",
            type=float,
            default=None,
            help="COUNTERS_SEND_DELAY_MS of the sender write mode, in ms (default 5).",
        )
        parser.add_argument(
            "--pushes",
            type=int,
            default=None,
            help="Pushes of the idempotency section per scheme, then three times as many "
            "(default 100000).",
        )
        parser.add_argument(
            "--flush-workers",
            default=None,
            help="Flusher processes the parallel section compares, comma-separated "
            "(default 1,2,4; speed-ups are against the smallest).",
        )
        parser.add_argument(
            "--redis-url",
            default=None,
            help="Redis of the buffer for this run (default: COUNTERS_REDIS_URL); with "
            "--cluster, any node of a Redis Cluster or a comma-separated list of nodes.",
        )
        parser.add_argument(
            "--cluster",
            action="store_true",
            help="The Redis is a Redis Cluster (sets COUNTERS_REDIS_CLUSTER for the run).",
        )
        parser.add_argument(
            "--modes",
            default=None,
            help=f"Comma-separated write modes of the writes section, from {','.join(MODES)} "
            f"(default: {','.join(DEFAULT_MODES)}; live and watched: a live counter, its keys "
            "unwatched or watched by a process of the bench's).",
        )
        parser.add_argument(
            "--sections",
            default=",".join(SECTIONS),
            help=f"Comma-separated subset of {','.join(SECTIONS)} (default: all).",
        )

    def _config(self, options: dict[str, Any]) -> BenchConfig:
        overrides: dict[str, Any] = {}
        if options["processes"] is not None:
            counts = self._processes(str(options["processes"]))
            overrides["processes"] = counts[-1]
            if len(counts) > 1:
                overrides["process_counts"] = counts
        for name, minimum in (("seconds", 0), ("rounds", 1)):
            value = options[name]
            if value is None:
                continue
            if value < minimum or (name == "seconds" and value == 0):
                bound = "greater than 0" if name == "seconds" else f"at least {minimum}"
                raise CommandError(f"--{name} must be {bound}, got {value}")
            overrides[name] = value
        if options["send_delay"] is not None:
            delay = options["send_delay"]
            if not 0 < delay <= 1000:
                raise CommandError(f"--send-delay must be in (0, 1000] ms, got {delay:g}")
            overrides["send_delay_ms"] = delay
        if options["pushes"] is not None:
            if options["pushes"] < 1:
                raise CommandError(f"--pushes must be at least 1, got {options['pushes']}")
            overrides["idem_pushes"] = options["pushes"]
        if options["flush_workers"] is not None:
            overrides["parallel_workers"] = self._workers(options["flush_workers"])
        if options["modes"] is not None:
            overrides["modes"] = self._modes(options["modes"])
        if options["quick"]:
            return BenchConfig.quick_run(**overrides)
        return BenchConfig.full(**overrides)

    def _processes(self, raw: str) -> tuple[int, ...]:
        parts = [p.strip() for p in raw.split(",")]
        try:
            counts = [int(p) for p in parts]
        except ValueError:
            counts = []
        if len(counts) == 1 and counts[0] < 1:
            raise CommandError(f"--processes must be at least 1, got {counts[0]}")
        if not counts or min(counts) < 1:
            raise CommandError(
                f"--processes takes a number or comma-separated numbers of at least 1, got {raw!r}"
            )
        return tuple(sorted(set(counts)))

    def _workers(self, raw: str) -> tuple[int, ...]:
        try:
            counts = sorted({int(n) for n in raw.split(",") if n.strip()})
        except ValueError:
            counts = []
        if not counts or counts[0] < 1:
            raise CommandError(
                f"--flush-workers takes comma-separated numbers of at least 1, got {raw!r}"
            )
        return tuple(counts)

    def _modes(self, raw: str) -> tuple[str, ...]:
        names = [n.strip() for n in raw.split(",") if n.strip()]
        unknown = [n for n in names if n not in MODES]
        if unknown or not names:
            raise CommandError(f"--modes takes names from {','.join(MODES)}, got {raw!r}")
        return tuple(m for m in MODES if m in names)

    def _sections(self, raw: str) -> tuple[str, ...]:
        names = [n.strip() for n in raw.split(",") if n.strip()]
        unknown = [n for n in names if n not in SECTIONS]
        if unknown or not names:
            raise CommandError(f"--sections takes names from {','.join(SECTIONS)}, got {raw!r}")
        return tuple(n for n in SECTIONS if n in names)

    def handle(self, *args: Any, **options: Any) -> None:
        config = self._config(options)
        sections = self._sections(options["sections"])
        from benchmarks import runner
        from benchmarks.errors import BenchError

        verbose = options["verbosity"] >= 2 or (options["verbosity"] >= 1 and not options["json"])

        def progress(message: str) -> None:
            if verbose:
                self.stderr.write(message)
                self.stderr.flush()

        try:
            results = runner.run(
                config,
                sections,
                progress,
                redis_url=options["redis_url"],
                cluster=options["cluster"],
            )
        except BenchError as exc:
            raise CommandError(str(exc)) from exc
        except counters.CountersError as exc:
            raise CommandError(first_line(exc)) from exc
        except RedisError as exc:
            raise CommandError(f"Redis error: {first_line(exc)}") from exc
        except DatabaseError as exc:
            raise CommandError(f"database error: {first_line(exc)}") from exc
        if options["json"]:
            self.stdout.write(json.dumps(results, indent=2))
        else:
            from benchmarks.report import render

            self.stdout.write(render(results))
