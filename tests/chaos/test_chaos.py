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

import shutil
from collections import Counter

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Count

from notifications.models import Notification, UnreadCounter
from tests.chaos.harness import CeleryFlusher, CommandFlusher, Config
from tests.chaos.trials import Trials, Wrong, missing_faults, run_all

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


def make_users(n: int) -> tuple[int, list[int]]:
    """A hot user and ``n`` others; returns (hot id, other ids)."""
    User = get_user_model()
    users = User.objects.bulk_create([User(username=f"chaos-{i}") for i in range(n + 1)])
    return users[0].pk, [u.pk for u in users[1:]]


def truth_by_user() -> dict[int, int]:
    rows = (
        Notification.objects.filter(is_read=False)
        .order_by()
        .values("recipient_id")
        .annotate(n=Count("pk"))
        .values_list("recipient_id", "n")
    )
    return dict(rows)


def unread_writer_args(others: list[int], hot: int) -> list[str]:
    """The arguments of ``tests.chaos.writer``: the users it writes to."""
    return [f"--users={','.join(map(str, others))}", f"--hot={hot}"]


def drift(user_ids: list[int]) -> Wrong:
    """{user: (stored, get_count, truth)} of every user whose figures disagree."""
    truth = truth_by_user()
    stored = dict(UnreadCounter.objects.values_list("user_id", "count"))
    exact = UnreadCounter.objects.get_counts(user_ids)
    wrong: Wrong = {}
    for user in user_ids:
        figures = (stored.get(user, 0), exact[user], truth.get(user, 0))
        if len(set(figures)) > 1:
            wrong[user] = figures
    return wrong


class UnreadTrials(Trials):
    """Notifications of many users and one hot user; the ``unread`` counter."""

    WRITER = "tests.chaos.writer"
    COUNTERS = ("unread",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hot, self.others = make_users(self.config.users)
        self.user_ids = [self.hot, *self.others]

    def writer_args(self) -> list[str]:
        return unread_writer_args(self.others, self.hot)

    def wrong(self) -> Wrong:
        return drift(self.user_ids)

    def sizes(self) -> dict[str, int]:
        truth = truth_by_user()
        return {
            "users": len(self.user_ids),
            "notifications": Notification.objects.count(),
            "unread": sum(truth.values()),
            "hot_unread": truth.get(self.hot, 0),
        }


#: Every kind of fault, the Redis restart included.
NEEDED = (
    "kills >= 3",
    "pg_terminate",
    "redis_restart",
    "kill inside a flush",
    "batch recovered",
    "stranded_committed",
    "celery flushed",
    "command flushed",
)


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
    trials = UnreadTrials(cfg, chaos_redis, command_flusher, celery_flusher, writer_env, tmp_path)
    run = run_all(trials, NEEDED)

    assert not missing_faults(run)
    assert run.total("kills") >= 3, "too few flusher kills to prove anything"
    assert run.total("chaos", "pg_terminate") >= 1, "no flusher connection was terminated"
    assert run.total("chaos", "redis_restart") >= 1, "Redis was never restarted"
    chaos: Counter[str] = Counter()
    for trial in run.trials:
        chaos.update(trial.chaos)
    assert chaos["kill_in_tx"] + chaos["kill_at_commit"] >= 1, "no kill inside a flush"
    assert run.total("flushes", "recovered") >= 1, "no kill ever left a batch in flight"
    assert chaos["stranded_committed"] >= 1, "no kill left a committed batch in flight"
    ledger = run.trials[-1].ledger
    assert ledger["celery_batches"] > 0, "the Celery worker never committed a batch"
    assert ledger["command_batches"] > 0, "the flush command never committed a batch"
