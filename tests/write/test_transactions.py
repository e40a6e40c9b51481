"""Only what commits counts: manual transactions, manual savepoints, failing callbacks,
a deadlock's victim, and reads inside a transaction that see its own changes."""

from __future__ import annotations

import contextlib

import pytest
from django.db import OperationalError, connection, transaction

import counters
from notifications.models import Notification, UnreadCounter
from tests.helpers import (
    assert_exact,
    cut_redis,
    deadlocked,
    race,
    restore_redis,
    stored,
    truth,
)

# One push after each COMMIT: what these tests follow is that push (the sender would merge it).
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
    pytest.mark.usefixtures("per_commit"),
]


@pytest.fixture
def manual():
    """Manual transaction management (autocommit off) on the default connection."""
    transaction.set_autocommit(False)
    try:
        yield
    finally:
        if not transaction.get_autocommit():
            transaction.rollback()
            transaction.set_autocommit(True)


def pending(user) -> int:
    member = f"unread:{user.pk}"
    return counters.get_buffer().snapshot([member]).pending[member]


def test_manual_rollback_sends_nothing(manual, make_user):
    alice = make_user()
    transaction.commit()
    for _ in range(5):
        Notification.objects.create(recipient=alice, verb="rolled back")
    assert pending(alice) == 0  # nothing leaves before the real COMMIT
    transaction.rollback()
    assert truth(alice) == 0
    assert_exact(alice)
    assert stored(alice) == 0


def test_manual_commit_sends_once(manual, make_user):
    alice = make_user()
    for _ in range(3):
        Notification.objects.create(recipient=alice, verb="v")
    assert pending(alice) == 0
    transaction.commit()
    assert pending(alice) == 3
    transaction.commit()  # an empty transaction sends nothing more
    assert pending(alice) == 3
    transaction.set_autocommit(True)
    assert_exact(alice)


def test_manual_commit_then_close_without_autocommit_still_sends(manual, make_user):
    alice = make_user()
    transaction.commit()
    Notification.objects.create(recipient=alice, verb="a")
    Notification.objects.create(recipient=alice, verb="b")
    transaction.commit()
    assert pending(alice) == 2
    Notification.objects.filter(recipient=alice).mark_all_read()  # atomic() inside
    transaction.commit()
    connection.close()  # autocommit never turned back on: Django drops its callbacks
    assert truth(alice) == 0
    assert_exact(alice)


def test_manual_close_without_commit_sends_nothing(manual, make_user):
    alice = make_user()
    transaction.commit()
    Notification.objects.create(recipient=alice, verb="never committed")
    connection.close()
    assert truth(alice) == 0
    assert_exact(alice)


@contextlib.contextmanager
def atomic_transaction():
    with transaction.atomic():
        yield


@contextlib.contextmanager
def manual_transaction():
    transaction.set_autocommit(False)
    try:
        yield
        transaction.commit()
    finally:
        transaction.set_autocommit(True)


@pytest.mark.parametrize(
    "outer", [atomic_transaction, manual_transaction], ids=["atomic", "manual"]
)
def test_manual_savepoint_rollback_drops_what_came_after_it(outer, make_user):
    alice, bob = make_user(), make_user()
    with outer():
        Notification.objects.create(recipient=alice, verb="kept")
        sid = transaction.savepoint()
        Notification.objects.create(recipient=alice, verb="rolled back")
        Notification.objects.create(recipient=bob, verb="rolled back")
        inner = transaction.savepoint()
        Notification.objects.create(recipient=bob, verb="rolled back with the outer one")
        transaction.savepoint_commit(inner)
        transaction.savepoint_rollback(sid)
        Notification.objects.create(recipient=bob, verb="kept after the rollback")
        transaction.savepoint_commit(sid)
        # SQLite has no savepoints outside atomic(): there nothing was rolled back
        expected = (1, 1) if sid is not None else (2, 3)
        assert (truth(alice), truth(bob)) == expected
        assert UnreadCounter.objects.get_counts([alice, bob]) == dict(
            zip((alice.pk, bob.pk), expected, strict=True)
        )
    assert (truth(alice), truth(bob)) == expected
    assert_exact(alice, bob)


def test_a_failing_on_commit_callback_does_not_swallow_the_deltas(make_user):
    alice = make_user()

    def broker_down():
        raise ConnectionError("broker unreachable")

    with pytest.raises(ConnectionError), transaction.atomic():
        transaction.on_commit(broker_down)  # registered before the counted changes
        Notification.objects.create(recipient=alice, verb="a")
        Notification.objects.create(recipient=alice, verb="b")
    assert truth(alice) == 2
    assert_exact(alice)


def test_reads_inside_a_transaction_include_its_own_changes(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="committed")
    with transaction.atomic():
        n = Notification.objects.create(recipient=alice, verb="mine")
        assert UnreadCounter.objects.get_count(alice) == truth(alice) == 2
        n.mark_read()
        assert UnreadCounter.objects.get_count(alice) == truth(alice) == 1
        try:
            with transaction.atomic():
                Notification.objects.create(recipient=alice, verb="rolled back")
                assert UnreadCounter.objects.get_count(alice) == 2
                raise ValueError
        except ValueError:
            pass
        assert UnreadCounter.objects.get_count(alice) == truth(alice) == 1
        assert pending(alice) == 1  # only the committed one is in Redis yet
    assert_exact(alice)


def test_reads_include_own_changes_while_redis_is_down(make_user, settings):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="committed")
    counters.flush()
    cut_redis(settings)
    with transaction.atomic():
        Notification.objects.create(recipient=alice, verb="mine")
        assert UnreadCounter.objects.get_count(alice) == truth(alice) == 2
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 2  # written directly


def test_atomic_request_answers_with_its_own_change(client, make_user, settings):
    from django.db import connection as conn

    alice = make_user()
    alice.set_password("pw")
    alice.save()
    notes = [Notification.objects.create(recipient=alice, verb=str(i)) for i in range(3)]
    client.force_login(alice)
    conn.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        response = client.post(f"/api/notifications/{notes[0].pk}/read/")
    finally:
        conn.settings_dict["ATOMIC_REQUESTS"] = False
    assert response.status_code == 200
    assert response.json()["unread"] == truth(alice) == 2
    assert_exact(alice)


def test_manual_commit_with_redis_down_writes_its_own_transaction(manual, make_user, settings):
    alice = make_user()
    transaction.commit()
    saved = cut_redis(settings)
    Notification.objects.create(recipient=alice, verb="a")
    Notification.objects.create(recipient=alice, verb="b")
    transaction.commit()  # the push fails: the deltas go to the row, committed on their own
    assert stored(alice) == 2
    Notification.objects.create(recipient=alice, verb="rolled back")
    transaction.rollback()  # the caller's next transaction is its own
    assert (truth(alice), stored(alice)) == (2, 2)
    restore_redis(settings, saved)
    transaction.rollback()  # end the reads' transaction
    transaction.set_autocommit(True)
    assert_exact(alice)


@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite locks the whole database")
def test_the_victim_of_a_deadlock_counts_nothing_and_the_survivor_counts_once(make_user):
    """Two transactions each mark one notification read, then delete the other's: each
    waits on the other, the database rolls one back, and only the survivor counts."""
    alice = make_user()
    notes = [Notification.objects.create(recipient=alice, verb=str(i)) for i in range(3)]
    counters.flush()

    def cross(i, barrier):
        try:
            with transaction.atomic():
                assert Notification.objects.get(pk=notes[i].pk).mark_read()
                barrier.wait(timeout=30)
                Notification.objects.get(pk=notes[1 - i].pk).delete()
        except OperationalError as exc:
            if not deadlocked(exc):
                raise
            return "victim"
        return "survivor"

    outcome = race(2, cross)
    assert sorted(outcome) == ["survivor", "victim"]
    survivor = outcome.index("survivor")
    read = Notification.objects.get(pk=notes[survivor].pk)
    assert read.is_read
    assert not Notification.objects.filter(pk=notes[1 - survivor].pk).exists()
    assert truth(alice) == 1  # the third one; the victim's mark_read rolled back
    assert_exact(alice)
    assert stored(alice) == 1
