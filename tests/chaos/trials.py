"""One chaos trial, whatever the writers write: processes, faults, the final drain and the checks.

A :class:`Trials` subclass says what its writers write (``WRITER``, their
arguments), which counters they change (``COUNTERS``), how far the stored
rows and the exact reads are from the SQL truth (:meth:`Trials.wrong`) and
what to print about the data (:meth:`Trials.sizes`). Every trial then runs
the same way: writer processes, the cron-style flusher and a Celery worker
under a chaos thread, then a drain until nothing is buffered, and checks:
no drift (after a rebuild if Redis was restarted) and a clean ledger audit.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import ClassVar

from django.db.models import Sum
from redis import RedisError

import counters
from counters.base.exceptions import FlushFailed
from counters.models import BufferEpoch
from counters.verify.rebuild import rebuild
from tests.chaos import audit
from tests.chaos.faults import Chaos
from tests.chaos.harness import CeleryFlusher, CommandFlusher, Config, Writers
from tests.chaos.report import Run, Trial
from tests.procs import database_url
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]

FLUSH_FIELDS = ("batches", "recovered", "already_applied")

#: {key: (stored, exact read, truth)} of the keys whose figures disagree.
Wrong = dict[Hashable, tuple[int, int, int]]


def reconnect() -> None:
    """Ping until this process's Redis connections work again after a restart."""
    for attempt in range(5):
        try:
            counters.get_client().ping()
            return
        except RedisError:
            if attempt == 4:
                raise
            time.sleep(0.2)


def drain(timeout: float = 60.0) -> Counter[str]:
    """Flush until nothing is pending or in flight (dead flushers' leases expire first)."""
    reconnect()
    buffer = counters.get_buffer()
    totals: Counter[str] = Counter()
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = counters.flush()
        except FlushFailed as exc:  # e.g. a lock timeout; its batch stays in flight
            result = exc.result
        for name in FLUSH_FIELDS:
            totals[name] += getattr(result, name)
        pending = sum(buffer.pending_count(s) for s in range(buffer.shards))
        inflight = buffer.inflight_ids()
        if not (pending or inflight or result.busy_shards):
            return totals
        assert time.monotonic() < deadline, (
            f"still buffered after {timeout:.0f}s: {pending} pending keys, in flight {inflight}, "
            f"busy shards {result.busy_shards}"
        )
        time.sleep(0.2)


def size(wrong: Wrong) -> tuple[int, int]:
    """(keys wrong, sum over them of the larger error of the stored row and the exact read)."""
    return len(wrong), sum(max(abs(s - t), abs(e - t)) for s, e, t in wrong.values())


def epoch_losses() -> int:
    return BufferEpoch.objects.aggregate(n=Sum("losses"))["n"] or 0


def missing_faults(run: Run) -> list[str]:
    """The kinds of fault the trials so far have not exercised yet, and flushers that have not
    committed a batch (the ledger audit tells them apart by their connection's name)."""
    chaos: Counter[str] = Counter()
    for trial in run.trials:
        chaos.update(trial.chaos)
    ledger = run.trials[-1].ledger if run.trials else {}
    seen = {
        "kills >= 3": run.total("kills") >= 3,
        "pg_terminate": chaos["pg_terminate"] >= 1,
        "redis_restart": chaos["redis_restart"] >= 1,
        "kill inside a flush": chaos["kill_in_tx"] + chaos["kill_at_commit"] >= 1,
        "batch recovered": run.total("flushes", "recovered") >= 1,
        "stranded_committed": chaos["stranded_committed"] >= 1,
        "celery flushed": ledger.get("celery_batches", 0) > 0,
        "command flushed": ledger.get("command_batches", 0) > 0,
    }
    return [name for name, ok in seen.items() if not ok]


class Trials:
    """Runs trials against one set of processes and checks each one."""

    #: The writers' module, run as ``python -m``.
    WRITER: ClassVar[str]
    #: The counters the writers change: drained, rebuilt after a Redis restart, audited.
    COUNTERS: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        config: Config,
        redis: RedisServer,
        command: CommandFlusher,
        celery: CeleryFlusher,
        writer_env: dict[str, str],
        logdir: Path,
    ) -> None:
        self.config = config
        self.redis = redis
        self.command = command
        self.celery = celery
        self.writer_env = writer_env
        self.logdir = logdir
        self.rnd = random.Random(config.seed)
        self.flush_base: Counter[str] = Counter()
        self.ledger: dict[str, int] = {}

    # -- what a subclass says -------------------------------------------------
    def writer_args(self) -> list[str]:
        """The writers' arguments besides seconds, seed, pause and name."""
        raise NotImplementedError

    def wrong(self) -> Wrong:
        """The keys whose stored row, exact read and SQL truth disagree."""
        raise NotImplementedError

    def sizes(self) -> dict[str, int]:
        """Figures of the data after a trial, for its line of the report."""
        raise NotImplementedError

    # -- a trial --------------------------------------------------------------
    def flusher_totals(self) -> Counter[str]:
        totals = Counter(self.command.totals)
        totals.update(self.celery.flush_totals())
        return totals

    def run(self, number: int) -> Trial:
        """One trial: write under chaos, drain, then check drift and the audit exactly."""
        trial = Trial(number, self.config.restarts_redis(number))
        losses = epoch_losses()
        started = time.monotonic()
        reports, chaos = self.write(trial, number)
        self.command.stop()
        self.celery.stop_worker()
        final = drain()

        for report in reports:
            trial.ops.update(report["ops"])
            trial.writer_errors.update(report["errors"])
        trial.chaos = chaos.stats
        flushed = self.flusher_totals()
        trial.flushes = flushed - self.flush_base
        trial.flushes.update(final)
        self.flush_base = flushed
        trial.lost_epochs = epoch_losses() - losses

        if trial.restart_redis:
            assert trial.chaos["redis_restart"] >= 1
            assert trial.lost_epochs >= 1, "Redis lost its data but no flush noticed"
            trial.drift_before_rebuild = size(self.wrong())
            for name in self.COUNTERS:
                rebuilt = rebuild(name, confirm_delay=0.3)
                assert not rebuilt.unstable, rebuilt.summary()
                trial.repaired += rebuilt.repaired
            drain()
        wrong = self.wrong()
        trial.drift = size(wrong)
        self.figures(trial)
        trial.seconds = time.monotonic() - started
        print(trial.line(), flush=True)
        if trial.writer_errors:
            print(f"  writer errors: {dict(trial.writer_errors)}", flush=True)
        assert not wrong, f"(stored, exact read, truth) of drifting keys: {wrong}"
        violations = audit.violations(self.COUNTERS)
        assert not violations, f"ledger audit failed: {violations}"
        assert trial.ledger["batches"] == trial.ledger["distinct_ids"]
        return trial

    def write(self, trial: Trial, number: int) -> tuple[list[dict], Chaos]:
        """Writers and flushers under the chaos thread until the writers are done."""
        cfg = self.config
        self.command.start()
        self.celery.start_worker()
        writers = Writers(ROOT, self.writer_env, self.logdir, module=self.WRITER)
        chaos = Chaos(
            dsn=database_url(),
            command=self.command,
            celery=self.celery,
            redis=self.redis,
            seconds=cfg.trial_seconds + 1,
            restart_redis=trial.restart_redis,
            rnd=random.Random(self.rnd.random()),
            buffer=counters.get_buffer(),
        )
        try:
            writers.start(
                cfg.writers,
                cfg.trial_seconds,
                seed=cfg.seed * 1000 + number,
                pause=cfg.writer_pause,
                args=self.writer_args(),
            )
            chaos.start()
            reports = writers.wait(cfg.trial_seconds + 90)
        finally:
            writers.kill()
            chaos.stopping.set()
            chaos.join(60)
        assert not chaos.is_alive(), "the chaos thread did not stop"
        assert not chaos.errors, f"the chaos thread failed: {chaos.errors[0]!r}"
        return reports, chaos

    def figures(self, trial: Trial) -> None:
        trial.sizes = self.sizes()
        before = self.ledger
        trial.ledger = self.ledger = audit.ledger_figures()
        trial.batches = trial.ledger["batches"] - before.get("batches", 0)
        trial.fallback = trial.ledger["fallback"] - before.get("fallback", 0)
        for flusher in ("command", "celery"):
            name = f"{flusher}_batches"
            trial.by_flusher[flusher] = trial.ledger[name] - before.get(name, 0)

    def logs(self) -> str:
        parts = [self.celery.log_tail()]
        for path in sorted(self.logdir.glob("*.log")):
            if not path.name.startswith("celery-"):
                parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)


def run_all(trials: Trials, needed: Sequence[str]) -> Run:
    """The config's trials; in quick mode, extra ones while a fault in ``needed`` is missing.

    ``needed`` names kinds of :func:`missing_faults`. The audit triggers are
    installed for the run and removed after it; the run's totals are printed.
    """
    cfg, command, celery = trials.config, trials.command, trials.celery
    audit.install(trials.COUNTERS)
    run = Run()
    started = time.monotonic()

    def missing() -> list[str]:
        return [name for name in missing_faults(run) if name in needed]

    try:
        while cfg.more_trials(len(run.trials), time.monotonic() - started, lacking := missing()):
            if lacking and len(run.trials) >= cfg.trials:
                print(f"chaos: one more trial, not seen yet: {', '.join(lacking)}", flush=True)
            run.trials.append(trials.run(len(run.trials) + 1))
            assert celery.beat_alive(), "celery beat died"
    except BaseException:
        print(trials.logs())
        raise
    finally:
        run.seconds = time.monotonic() - started
        if run.trials:
            print(run.line(), flush=True)
            print(run.ops_line(), flush=True)
            print(
                f"chaos flushers: command runs {dict(command.exits)}, "
                f"celery worker starts {celery.starts}",
                flush=True,
            )
        audit.uninstall()
    assert run.drift == 0
    assert not missing(), f"faults that never happened: {missing()}"
    return run
