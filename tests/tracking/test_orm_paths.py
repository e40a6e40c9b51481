"""Every ORM path that changes unread state keeps the count exact (issue: all paths)."""

from __future__ import annotations

import pytest
from django.db import NotSupportedError, transaction
from django.db.models import Case, Value, When

import counters
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def test_two_stale_instances_saved_read_decrement_once(make_user):
    alice = make_user()
    n = Notification.objects.create(recipient=alice, verb="v")
    first, second = Notification.objects.get(pk=n.pk), Notification.objects.get(pk=n.pk)
    first.is_read = True
    first.save()
    second.is_read = True
    second.save()
    assert UnreadCounter.objects.get_count(alice) == 0
    assert_exact(alice)


def test_stale_instance_cannot_resurrect_a_count(make_user):
    alice = make_user()
    n = Notification.objects.create(recipient=alice, verb="v")
    stale = Notification.objects.get(pk=n.pk)  # loaded unread
    n.mark_read()
    stale.verb = "edited"
    stale.save()  # writes is_read=False back: that is a real change, counted +1
    assert Notification.objects.get(pk=n.pk).is_read is False
    assert_exact(alice)
    assert stored(alice) == 1


def test_save_moving_an_unread_notification_moves_the_count(make_user):
    alice, bob = make_user(), make_user()
    n = Notification.objects.create(recipient=alice, verb="v")
    n.recipient = bob
    n.save()
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 0, bob.pk: 1}
    assert_exact(alice, bob)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(["verb"], {"alice": 1, "bob": 0}, id="uncounted-field"),
        pytest.param(["is_read"], {"alice": 0, "bob": 0}, id="is_read-only"),
        pytest.param(["recipient"], {"alice": 0, "bob": 1}, id="recipient-only"),
        pytest.param(["recipient", "is_read"], {"alice": 0, "bob": 0}, id="both"),
    ],
)
def test_save_with_update_fields_counts_only_saved_fields(make_user, fields, expected):
    alice, bob = make_user(), make_user()
    n = Notification.objects.create(recipient=alice, verb="v")
    n.recipient, n.is_read, n.verb = bob, True, "changed"
    n.save(update_fields=fields)
    counts = UnreadCounter.objects.get_counts([alice, bob])
    assert {"alice": counts[alice.pk], "bob": counts[bob.pk]} == expected
    assert_exact(alice, bob)


def test_queryset_update_of_is_read_and_recipient(make_user):
    alice, bob, carol = make_user(), make_user(), make_user()
    for user in (alice, alice, alice, bob):
        Notification.objects.create(recipient=user, verb="v")
    Notification.objects.create(recipient=bob, verb="v", is_read=True)
    assert Notification.objects.filter(recipient=alice).update(recipient=carol) == 3
    assert Notification.objects.filter(recipient=bob).update(is_read=False) == 2
    assert Notification.objects.filter(recipient=carol).update(verb="only text") == 3
    assert UnreadCounter.objects.get_counts([alice, bob, carol]) == {
        alice.pk: 0,
        bob.pk: 2,
        carol.pk: 3,
    }
    assert_exact(alice, bob, carol)


def test_queryset_update_with_an_expression_is_reread(make_user):
    alice = make_user()
    for i in range(4):
        Notification.objects.create(recipient=alice, verb=str(i), is_read=bool(i % 2))
    Notification.objects.filter(recipient=alice).update(
        is_read=Case(When(is_read=True, then=Value(False)), default=Value(True))
    )
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 2
    assert_exact(alice)


def test_sliced_update_and_delete_are_refused_like_django():
    with pytest.raises(TypeError):
        Notification.objects.all()[:1].update(is_read=True)
    with pytest.raises(TypeError):
        Notification.objects.all()[:1].delete()


def test_bulk_create_counts_unread_rows(make_user):
    alice, bob = make_user(), make_user()
    Notification.objects.bulk_create(
        [
            Notification(recipient=alice, verb="a"),
            Notification(recipient=alice, verb="b"),
            Notification(recipient=bob, verb="c", is_read=True),
        ]
    )
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 2, bob.pk: 0}
    assert_exact(alice, bob)


def test_bulk_create_refuses_conflict_modes_it_cannot_count(make_user):
    alice = make_user()
    with pytest.raises(NotSupportedError, match="ignore_conflicts"):
        Notification.objects.bulk_create([Notification(recipient=alice)], ignore_conflicts=True)
    assert Notification.objects.count() == 0


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_notify_fans_out_with_one_delta_per_recipient(make_user, monkeypatch):
    from counters.buffer.store import Buffer

    users = [make_user() for _ in range(25)]
    pushes = []
    real = Buffer.push
    monkeypatch.setattr(
        Buffer, "push", lambda self, d, pid: pushes.append(dict(d)) or real(self, d, pid)
    )
    assert Notification.objects.notify(users + users[:5], verb="v", batch_size=7) == 30
    assert len(pushes) == 1
    assert sorted(pushes[0].values()) == [1] * 20 + [2] * 5
    assert_exact(*users)


def test_queryset_delete_counts_per_recipient(make_user):
    alice, bob = make_user(), make_user()
    for user in (alice, alice, bob):
        Notification.objects.create(recipient=user, verb="v")
    Notification.objects.create(recipient=bob, verb="v", is_read=True)
    counters.flush()
    deleted, per_model = Notification.objects.filter(verb="v").delete()
    assert (deleted, per_model) == (4, {"notifications.Notification": 4})
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 0, bob.pk: 0}
    assert_exact(alice, bob)


def test_deleting_a_user_removes_its_counter_and_a_later_flush_does_not_recreate_it(make_user):
    alice, bob = make_user(), make_user()
    Notification.objects.create(recipient=alice, verb="v")
    counters.flush()
    assert UnreadCounter.objects.filter(user=alice).exists()
    Notification.objects.create(recipient=alice, verb="buffered")
    Notification.objects.create(recipient=bob, verb="v")
    alice_pk = alice.pk
    alice.delete()
    assert not UnreadCounter.objects.filter(user_id=alice_pk).exists()
    result = counters.flush()
    assert result.dropped == 1
    assert not UnreadCounter.objects.filter(user_id=alice_pk).exists()
    assert_exact(bob)


def test_nested_atomic_sends_surviving_deltas_once_at_outer_commit(make_user):
    alice = make_user()
    with transaction.atomic():
        a = Notification.objects.create(recipient=alice, verb="outer")
        with transaction.atomic():
            Notification.objects.create(recipient=alice, verb="inner kept")
            try:
                with transaction.atomic():
                    a.mark_read()
                    Notification.objects.create(recipient=alice, verb="rolled back")
                    raise ValueError
            except ValueError:
                pass
        assert counters.get_value("unread", alice.pk) == 2  # its own changes, not yet sent
        member = f"unread:{alice.pk}"
        assert counters.get_buffer().snapshot([member]).pending == {member: 0}
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 2
    assert_exact(alice)


def test_bulk_update_goes_through_the_counted_update(make_user):
    alice, bob = make_user(), make_user()
    notes = [Notification.objects.create(recipient=alice, verb=str(i)) for i in range(4)]
    notes[0].is_read = True
    notes[1].recipient = bob
    notes[2].is_read, notes[2].recipient = True, bob
    assert Notification.objects.bulk_update(notes, ["is_read", "recipient"], batch_size=2) == 4
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 1, bob.pk: 1}
    assert_exact(alice, bob)


def test_get_or_create_and_update_or_create_are_counted(make_user):
    alice = make_user()
    n, created = Notification.objects.get_or_create(recipient=alice, verb="once")
    assert created
    assert Notification.objects.get_or_create(recipient=alice, verb="once")[1] is False
    Notification.objects.update_or_create(pk=n.pk, defaults={"is_read": True})
    Notification.objects.update_or_create(recipient=alice, verb="new", defaults={"is_read": False})
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 1
    assert_exact(alice)
