"""Chaos: counts stay exact while real flushers are killed, disconnected and Redis restarts.

Each trial runs writer processes (a random mix of every counted path over
many users and one hot user), ``notification_update_counter`` back to back
and a Celery worker + beat flushing every second, while a chaos thread
SIGKILLs the flushers, terminates their DB connections mid-flush and, in some
trials, restarts Redis empty. Then the writers stop, the flushers stop, a
final flush drains the buffer and:

* in trials without a Redis restart, with no rebuild, every stored
  ``UnreadCounter`` and every ``get_count()`` equals the COUNT(*) truth:
  exactly once under kills;
* in trials with a restart, the drift Redis caused is reported, a rebuild
  repairs it, and then the same holds;
* always, the audit triggers find every counter change in exactly one
  ledgered transaction that matches its ledger row.
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Count, Sum
from redis import RedisError

import counters
from counters.base.exceptions import FlushFailed
from counters.models import BufferEpoch
from counters.verify.rebuild import rebuild
from notifications.models import Notification, UnreadCounter
from tests.chaos import audit
from tests.chaos.faults import Chaos
from tests.chaos.harness import CeleryFlusher, CommandFlusher, Config, Writers
from tests.chaos.report import Run, Trial
from tests.procs import database_url

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="chaos: writer and flusher subprocesses share the test database, kill its "
        "connections with pg_terminate_backend and audit it with triggers: PostgreSQL only",
    ),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]

FLUSH_FIELDS = ("batches", "recovered", "already_applied")


def make_users(n: int) -> tuple[int, list[int]]:
    """A hot user and ``n`` others; returns (hot id, other ids)."""
    User = get_user_model()
    users = User.objects.bulk_create([User(username=f"chaos-{i}") for i in range(n + 1)])
    return users[0].pk, [u.pk for u in users[1:]]


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


def truth_by_user() -> dict[int, int]:
    rows = (
        Notification.objects.filter(is_read=False)
        .order_by()
        .values("recipient_id")
        .annotate(n=Count("pk"))
        .values_list("recipient_id", "n")
    )
    return dict(rows)


def drift(user_ids: list[int]) -> dict[int, tuple[int, int, int]]:
    """{user: (stored, get_count, truth)} of every user whose figures disagree."""
    truth = truth_by_user()
    stored = dict(UnreadCounter.objects.values_list("user_id", "count"))
    exact = UnreadCounter.objects.get_counts(user_ids)
    wrong = {}
    for user in user_ids:
        figures = (stored.get(user, 0), exact[user], truth.get(user, 0))
        if len(set(figures)) > 1:
            wrong[user] = figures
    return wrong


def size(wrong: dict[int, tuple[int, int, int]]) -> tuple[int, int]:
    """(users wrong, sum over them of the larger error of stored and get_count)."""
    return len(wrong), sum(max(abs(s - t), abs(e - t)) for s, e, t in wrong.values())


def epoch_losses() -> int:
    return BufferEpoch.objects.aggregate(n=Sum("losses"))["n"] or 0


class Trials:
    """Runs trials against one set of processes and checks each one."""

    def __init__(self, config: Config, redis, command, celery, writer_env, logdir: Path) -> None:
        self.config = config
        self.redis = redis
        self.command = command
        self.celery = celery
        self.writer_env = writer_env
        self.logdir = logdir
        self.rnd = random.Random(config.seed)
        self.hot, self.others = make_users(config.users)
        self.user_ids = [self.hot, *self.others]
        self.flush_base: Counter[str] = Counter()
        self.ledger: dict[str, int] = {}

    def flusher_totals(self) -> Counter[str]:
        totals = Counter(self.command.totals)
        totals.update(self.celery.flush_totals())
        return totals

    def run(self, number: int) -> Trial:
        cfg = self.config
        trial = Trial(number, cfg.restarts_redis(number))
        losses = epoch_losses()
        started = time.monotonic()
        self.command.start()
        self.celery.start_worker()
        writers = Writers(ROOT, self.writer_env, self.logdir)
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
                self.others,
                self.hot,
                seed=cfg.seed * 1000 + number,
                pause=cfg.writer_pause,
            )
            chaos.start()
            reports = writers.wait(cfg.trial_seconds + 90)
        finally:
            writers.kill()
            chaos.stopping.set()
            chaos.join(60)
        assert not chaos.is_alive(), "the chaos thread did not stop"
        assert not chaos.errors, f"the chaos thread failed: {chaos.errors[0]!r}"
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
            trial.drift_before_rebuild = size(drift(self.user_ids))
            report = rebuild("unread", confirm_delay=0.3)
            assert not report.unstable, report.summary()
            trial.repaired = report.repaired
            drain()
        wrong = drift(self.user_ids)
        trial.drift = size(wrong)
        self.figures(trial)
        trial.seconds = time.monotonic() - started
        print(trial.line(), flush=True)
        if trial.writer_errors:
            print(f"  writer errors: {dict(trial.writer_errors)}", flush=True)
        assert not wrong, f"(stored, get_count, truth) of drifting users: {wrong}"
        violations = audit.violations()
        assert not violations, f"ledger audit failed: {violations}"
        assert trial.ledger["batches"] == trial.ledger["distinct_ids"]
        return trial

    def figures(self, trial: Trial) -> None:
        trial.users = len(self.user_ids)
        trial.notifications = Notification.objects.count()
        truth = truth_by_user()
        trial.unread = sum(truth.values())
        trial.hot_unread = truth.get(self.hot, 0)
        before = self.ledger
        trial.ledger = self.ledger = audit.ledger_figures()
        trial.batches = trial.ledger["batches"] - before.get("batches", 0)
        trial.fallback = trial.ledger["fallback"] - before.get("fallback", 0)

    def logs(self) -> str:
        parts = [self.celery.log_tail()]
        for path in sorted(self.logdir.glob("*.log")):
            if not path.name.startswith("celery-"):
                parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)


def missing_faults(
    run: Run, command_flusher: CommandFlusher, celery_flusher: CeleryFlusher
) -> list[str]:
    """The kinds of fault (and flusher) the trials so far have not exercised yet."""
    chaos: Counter[str] = Counter()
    for trial in run.trials:
        chaos.update(trial.chaos)
    seen = {
        "kills >= 3": run.total("kills") >= 3,
        "pg_terminate": chaos["pg_terminate"] >= 1,
        "redis_restart": chaos["redis_restart"] >= 1,
        "kill inside a flush": chaos["kill_in_tx"] + chaos["kill_at_commit"] >= 1,
        "batch recovered": run.total("flushes", "recovered") >= 1,
        "stranded_committed": chaos["stranded_committed"] >= 1,
        "celery flushed": celery_flusher.flush_totals()["batches"] > 0,
        "command flushed": command_flusher.totals["batches"] > 0,
    }
    return [name for name, ok in seen.items() if not ok]


def test_counts_stay_exact_under_kills_disconnects_and_redis_restarts(
    chaos_config: Config,
    chaos_settings,
    chaos_redis,
    command_flusher: CommandFlusher,
    celery_flusher: CeleryFlusher,
    writer_env,
    tmp_path,
):
    cfg = chaos_config
    mode = f"soak {cfg.minutes:g} min" if cfg.minutes else "quick"
    print(
        f"\nchaos {mode}: seed={cfg.seed} "
        f"writers={cfg.writers} users={cfg.users}+1 hot shards={cfg.shards} "
        f"batch_size={cfg.batch_size} lease_timeout={cfg.lease_timeout}s "
        f"trial={cfg.trial_seconds:.0f}s",
        flush=True,
    )
    audit.install()
    run = Run()
    started = time.monotonic()
    trials = Trials(cfg, chaos_redis, command_flusher, celery_flusher, writer_env, tmp_path)
    try:
        while cfg.more_trials(
            len(run.trials),
            time.monotonic() - started,
            missing := missing_faults(run, command_flusher, celery_flusher),
        ):
            if missing and len(run.trials) >= cfg.trials:
                print(f"chaos: one more trial, not seen yet: {', '.join(missing)}", flush=True)
            run.trials.append(trials.run(len(run.trials) + 1))
            assert celery_flusher.beat_alive(), "celery beat died"
    except BaseException:
        print(trials.logs())
        raise
    finally:
        run.seconds = time.monotonic() - started
        if run.trials:
            print(run.line(), flush=True)
            print(run.ops_line(), flush=True)
            print(
                f"chaos flushers: command runs {dict(command_flusher.exits)}, "
                f"celery worker starts {celery_flusher.starts}",
                flush=True,
            )
        audit.uninstall()

    assert run.drift == 0
    assert not missing_faults(run, command_flusher, celery_flusher)
    assert run.total("kills") >= 3, "too few flusher kills to prove anything"
    assert run.total("chaos", "pg_terminate") >= 1, "no flusher connection was terminated"
    assert run.total("chaos", "redis_restart") >= 1, "Redis was never restarted"
    chaos = Counter()
    for trial in run.trials:
        chaos.update(trial.chaos)
    assert chaos["kill_in_tx"] + chaos["kill_at_commit"] >= 1, "no kill inside a flush"
    assert run.total("flushes", "recovered") >= 1, "no kill ever left a batch in flight"
    assert chaos["stranded_committed"] >= 1, "no kill left a committed batch in flight"
    assert celery_flusher.flush_totals()["batches"] > 0, "the Celery worker never flushed"
    assert command_flusher.totals["batches"] > 0, "the flush command never flushed"
