"""Several databases: each alias has its own buffer, flush, status and rebuild.

The test settings add a second database, "other", with the same tables. The
same user id exists on both with different notifications, so a delta that
reached the wrong database would show at once.
"""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import OperationalError, transaction
from django_celery_beat.models import PeriodicTask
from redis import TimeoutError as RedisTimeoutError

import counters
from counters.buffer.store import Buffer
from counters.client import flushed_databases, get_buffer
from counters.flushing.settle import settle_fallbacks
from counters.models import FlushBatch
from counters.ops import run as flushing
from counters.ops.schedule import PERIODIC_TASK_NAME
from counters.tasks import flush_counters
from counters.verify.rebuild import rebuild
from notifications.apps import UNREAD_COUNTER
from notifications.models import Notification, UnreadCounter

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
    pytest.mark.redis,
]

BOTH = ("default", "other")


def truth(alias: str, user_id: int) -> int:
    return Notification.objects.using(alias).filter(recipient_id=user_id, is_read=False).count()


def stored(alias: str, user_id: int) -> int:
    rows = UnreadCounter.objects.using(alias).filter(user_id=user_id)
    return rows.values_list("count", flat=True).first() or 0


def exact(alias: str, user_id: int) -> int:
    return UnreadCounter.objects.db_manager(alias).get_count(user_id)


def state(*user_ids: int) -> dict:
    """{(alias, user id): (truth, get_count, stored)} on both databases."""
    return {
        (alias, pk): (truth(alias, pk), exact(alias, pk), stored(alias, pk))
        for alias in BOTH
        for pk in user_ids
    }


def notify(alias: str, user_id: int, unread: int) -> None:
    for _ in range(unread):
        Notification.objects.using(alias).create(recipient_id=user_id, verb="v")


@pytest.fixture
def users():
    """Alice (one id on both databases) and Bob, who exists on "other" only."""
    User = get_user_model()
    alice = User.objects.create(username="alice")
    User.objects.db_manager("other").create(pk=alice.pk, username="alice")
    bob = User.objects.db_manager("other").create(pk=alice.pk + 1, username="bob")
    return alice.pk, bob.pk


@pytest.fixture
def all_databases(settings):
    """Flushes without an alias drain every database the routers allow (the default rule)."""
    settings.COUNTERS_DATABASES = None
    assert flushed_databases() == ["default", "other"]


class CountersOnDefaultOnly:
    """A router that keeps the counters app's tables on "default"."""

    def allow_migrate(self, db, app_label, **hints):
        return db == "default" if app_label == "counters" else None


def test_databases_default_rule_follows_the_routers(settings):
    settings.COUNTERS_DATABASES = None
    assert flushed_databases() == ["default", "other"]
    settings.DATABASE_ROUTERS = [f"{__name__}.CountersOnDefaultOnly"]
    assert flushed_databases() == ["default"]


def test_databases_setting_from_the_environment(settings, monkeypatch):
    del settings.COUNTERS_DATABASES
    monkeypatch.setenv("COUNTERS_DATABASES", " other, default ,")
    assert flushed_databases() == ["other", "default"]


def test_each_database_has_its_own_buffer(counters_prefix):
    assert get_buffer().prefix == counters_prefix
    assert get_buffer("default") is get_buffer()
    assert get_buffer("other").prefix == f"{counters_prefix}.other"


def test_deltas_go_back_to_the_database_they_were_recorded_on(users):
    alice, bob = users
    notify("default", alice, 1)
    notify("other", alice, 2)
    notify("other", bob, 1)
    Notification.objects.using("other").filter(recipient_id=alice).first().mark_read()
    assert state(alice, bob) == {
        ("default", alice): (1, 1, 0),
        ("other", alice): (1, 1, 0),
        ("default", bob): (0, 0, 0),
        ("other", bob): (1, 1, 0),
    }
    counters.flush(using="other")
    assert state(alice, bob) == {
        ("default", alice): (1, 1, 0),  # still pending: only "other" was flushed
        ("other", alice): (1, 1, 1),
        ("default", bob): (0, 0, 0),
        ("other", bob): (1, 1, 1),
    }
    counters.flush(using="default")
    assert all(t == e == s for t, e, s in state(alice, bob).values())
    assert not UnreadCounter.objects.filter(user_id=bob).exists()


def test_flush_without_alias_drains_every_database(users, all_databases):
    alice, bob = users
    notify("default", alice, 2)
    with transaction.atomic(using="other"):
        notify("other", alice, 3)
        notify("other", bob, 1)
    result = counters.flush()
    assert (result.batches > 0, result.keys, result.deltas) == (True, 3, 6)
    assert state(alice, bob) == {
        ("default", alice): (2, 2, 2),
        ("other", alice): (3, 3, 3),
        ("default", bob): (0, 0, 0),
        ("other", bob): (1, 1, 1),
    }


def test_flush_without_alias_keeps_to_counters_databases(users, settings):
    alice, _ = users
    settings.COUNTERS_DATABASES = ["other"]
    notify("default", alice, 1)
    notify("other", alice, 1)
    counters.flush()
    assert (stored("default", alice), stored("other", alice)) == (0, 1)
    assert exact("default", alice) == truth("default", alice) == 1


def test_periodic_task_flushes_every_database(users, all_databases):
    alice, bob = users
    notify("default", alice, 1)
    notify("other", bob, 2)
    assert flush_counters() is None  # nothing for the worker to log or store
    assert (stored("default", alice), stored("other", bob)) == (1, 2)


@pytest.mark.parametrize(
    ("args", "flushed"),
    [
        pytest.param(["--database", "other"], {"other"}, id="database-other"),
        pytest.param(["--database", "default"], {"default"}, id="database-default"),
        pytest.param([], {"default", "other"}, id="every-database"),
    ],
)
def test_update_counter_command_flushes_its_databases(users, all_databases, args, flushed):
    alice, _ = users
    notify("default", alice, 1)
    notify("other", alice, 2)
    out = StringIO()
    call_command("notification_update_counter", "--json", *args, stdout=out)
    data = json.loads(out.getvalue())
    if len(flushed) == 1:
        data = {flushed.copy().pop(): data}
    assert {alias: d["keys"] for alias, d in data.items()} == dict.fromkeys(flushed, 1)
    for alias in BOTH:
        assert stored(alias, alice) == (truth(alias, alice) if alias in flushed else 0)
        assert exact(alias, alice) == truth(alias, alice)


def test_a_failing_database_does_not_stop_the_others(users, all_databases, monkeypatch, caplog):
    alice, _ = users
    notify("default", alice, 1)
    notify("other", alice, 2)
    real_settle = settle_fallbacks

    def settle_or_fail(buffer, using="default", limit=500):
        if using == "default":
            raise OperationalError("default is down")
        return real_settle(buffer, using, limit)

    monkeypatch.setattr(flushing, "settle_fallbacks", settle_or_fail)
    with pytest.raises(CommandError, match="database error: default is down"):
        call_command("notification_update_counter", stdout=StringIO())
    assert "flush of database 'default' failed: default is down" in caplog.text
    assert (stored("default", alice), stored("other", alice)) == (0, 2)
    monkeypatch.undo()
    counters.flush()
    assert all(t == e == s for t, e, s in state(alice).values())


def test_update_counter_command_lines_name_their_database(users, all_databases):
    out = StringIO()
    call_command("notification_update_counter", stdout=out)
    lines = out.getvalue().strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["default", "other"]


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_status_command_shows_the_buffer_of_its_database(users, counters_prefix):
    alice, bob = users
    notify("other", alice, 1)
    notify("other", bob, 1)
    notify("default", alice, 1)
    statuses = {}
    for alias in BOTH:
        out = StringIO()
        call_command("counters_status", "--json", "--database", alias, stdout=out)
        statuses[alias] = json.loads(out.getvalue())
    assert statuses["other"]["prefix"] == f"{counters_prefix}.other"
    assert {a: s["totals"]["pending_keys"] for a, s in statuses.items()} == {
        "default": 1,
        "other": 2,
    }


def test_rebuild_on_other_compares_with_others_truth(users):
    alice, bob = users
    notify("default", alice, 3)
    notify("other", alice, 1)
    counters.flush(using="other")
    UnreadCounter.objects.using("other").filter(user_id=alice).update(count=7)  # drift
    report = rebuild(UNREAD_COUNTER, using="other", confirm_delay=0)
    assert [(d.key, d.truth) for d in report.wrong] == [(alice, 1)]
    counters.flush(using="other")
    counters.flush(using="default")
    assert all(t == e == s for t, e, s in state(alice, bob).values())


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_fallback_write_on_other_is_settled_with_others_buffer(users, monkeypatch):
    """A push to "other"'s buffer that timed out but landed: the direct write is taken back."""
    alice, _ = users
    real_push = Buffer.push

    def push_then_time_out(self, deltas, push_id):
        real_push(self, deltas, push_id)
        raise RedisTimeoutError("Timeout reading from socket")

    monkeypatch.setattr(Buffer, "push", push_then_time_out)
    notify("other", alice, 1)
    monkeypatch.undo()
    notify("default", alice, 2)  # pending for "default" under the same key
    assert FlushBatch.objects.using("other").filter(unsettled__isnull=False).count() == 1
    assert not FlushBatch.objects.filter(unsettled__isnull=False).exists()
    result = counters.flush(using="other")
    assert result.compensated == 1
    assert (truth("other", alice), exact("other", alice), stored("other", alice)) == (1, 1, 1)
    counters.flush(using="default")
    assert all(t == e == s for t, e, s in state(alice).values())


def test_migrate_on_the_other_database_works():
    call_command("migrate", database="other", verbosity=0)
    assert PeriodicTask.objects.filter(name=PERIODIC_TASK_NAME).count() == 1
    assert not PeriodicTask.objects.using("other").filter(name=PERIODIC_TASK_NAME).exists()
