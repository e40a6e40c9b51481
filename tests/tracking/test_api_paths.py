"""Every public API of notifications keeps get_count and the stored rows exact."""

from __future__ import annotations

import pytest
from django.db import transaction

import counters
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
]


def test_create_unread_counts_one_and_read_counts_zero(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="unread")
    Notification.objects.create(recipient=alice, verb="already read", is_read=True)
    assert truth(alice) == 1
    assert UnreadCounter.objects.get_count(alice) == 1
    assert stored(alice) == 0  # nothing flushed yet
    assert_exact(alice)
    assert stored(alice) == 1


def test_mark_read_and_unread_return_whether_they_changed_the_row(make_user):
    alice = make_user()
    n = Notification.objects.create(recipient=alice, verb="v")
    assert n.mark_read() is True
    assert n.mark_read() is False
    assert n.is_read and n.read_at is not None
    assert_exact(alice)
    assert UnreadCounter.objects.get_count(alice) == 0
    assert n.mark_unread() is True
    assert n.mark_unread() is False
    assert n.read_at is None
    assert_exact(alice)
    assert stored(alice) == 1


def test_mark_all_read_returns_rows_changed_and_counts_per_recipient(make_user):
    alice, bob = make_user(), make_user()
    for _ in range(3):
        Notification.objects.create(recipient=alice, verb="a")
    for _ in range(2):
        Notification.objects.create(recipient=bob, verb="b")
    Notification.objects.create(recipient=bob, verb="read", is_read=True)
    counters.flush()
    assert (stored(alice), stored(bob)) == (3, 2)
    assert Notification.objects.all().mark_all_read() == 5
    assert Notification.objects.all().mark_all_read() == 0
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 0, bob.pk: 0}
    assert_exact(alice, bob)


def test_mark_all_read_of_one_recipient_leaves_others(make_user):
    alice, bob = make_user(), make_user()
    for user in (alice, alice, bob):
        Notification.objects.create(recipient=user, verb="x")
    assert Notification.objects.filter(recipient=alice).mark_all_read() == 2
    assert UnreadCounter.objects.get_count(bob) == 1
    assert_exact(alice, bob)


def test_delete_of_unread_counts_minus_one_and_of_read_counts_zero(make_user):
    alice = make_user()
    unread = Notification.objects.create(recipient=alice, verb="u")
    read = Notification.objects.create(recipient=alice, verb="r", is_read=True)
    Notification.objects.create(recipient=alice, verb="stays")
    counters.flush()
    unread.delete()
    read.delete()
    assert UnreadCounter.objects.get_count(alice) == 1
    assert_exact(alice)


def test_get_count_of_a_user_with_nothing_is_zero(make_user):
    alice = make_user()
    assert UnreadCounter.objects.get_count(alice) == 0
    assert UnreadCounter.objects.get_count(alice.pk) == 0


def test_rolled_back_transaction_leaves_no_delta(make_user, redis_client, counters_prefix):
    alice = make_user()
    with pytest.raises(RuntimeError), transaction.atomic():
        Notification.objects.create(recipient=alice, verb="never")
        raise RuntimeError("roll back")
    assert list(redis_client.scan_iter(match=f"{counters_prefix}:*pending")) == []
    assert UnreadCounter.objects.get_count(alice) == 0
    assert_exact(alice)


def test_rolled_back_savepoint_drops_only_its_deltas(make_user):
    alice, bob = make_user(), make_user()
    with transaction.atomic():
        Notification.objects.create(recipient=alice, verb="kept")
        try:
            with transaction.atomic():
                Notification.objects.create(recipient=bob, verb="dropped")
                Notification.objects.create(recipient=alice, verb="dropped")
                raise RuntimeError
        except RuntimeError:
            pass
        with transaction.atomic():
            Notification.objects.create(recipient=alice, verb="kept in a savepoint")
        # a read inside the transaction sees its own changes; nothing leaves before COMMIT
        assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 2, bob.pk: 0}
        members = [f"unread:{alice.pk}", f"unread:{bob.pk}"]
        assert counters.get_buffer().snapshot(members).pending == dict.fromkeys(members, 0)
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 2, bob.pk: 0}
    assert_exact(alice, bob)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_one_transaction_sends_one_push(make_user, redis_client, counters_prefix, monkeypatch):
    from counters.buffer.store import Buffer

    calls = []
    original = Buffer.push
    monkeypatch.setattr(
        Buffer, "push", lambda self, d, pid: calls.append(dict(d)) or original(self, d, pid)
    )
    alice, bob = make_user(), make_user()
    with transaction.atomic():
        for user in (alice, bob, alice):
            Notification.objects.create(recipient=user, verb="x")
        with transaction.atomic():
            Notification.objects.create(recipient=bob, verb="y")
    assert calls == [{f"unread:{alice.pk}": 2, f"unread:{bob.pk}": 2}]
    assert_exact(alice, bob)
