"""Receivers that save again, or raise, whatever their order with Tally's.

Django imports every ``models.py`` before any ``ready()``, so a receiver
connected in a ``models.py`` runs before anything ``track()`` connects. A
save is counted from what its own statement wrote, so a receiver that saves
the instance again (its own counted change), changes it without saving, or
raises, never changes what the first save counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import transaction
from django.db.models.signals import ModelSignal, post_save, pre_save

from counters.tracking import routes
from notifications.models import Notification
from tests.helpers import assert_exact, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

UID = "tests.capture_nested_saves"
ORDERS = ["receiver-first", "receiver-last"]


@contextmanager
def receiver(signal: ModelSignal, func: Callable[..., Any], order: str) -> Iterator[None]:
    """Connect ``func`` for Notification, before Tally's receivers or after them."""
    signal.connect(func, sender=Notification, dispatch_uid=UID)
    if order == "receiver-first":
        # as in a models.py: Tally's receivers connected afterwards, in ready()
        for name, tally_signal in (("pre_save", pre_save), ("post_save", post_save)):
            tally_signal.disconnect(
                sender=Notification, dispatch_uid=f"counters:notifications.Notification:{name}"
            )
        routes.connect_model(Notification)
    try:
        yield
    finally:
        signal.disconnect(sender=Notification, dispatch_uid=UID)


def resave_untracked(sender, instance, created, raw, **kwargs) -> None:
    """Saves the instance again, a field that no counter reads (like a slug)."""
    if not raw and instance.description != "seen":
        instance.description = "seen"
        instance.save(update_fields=["description"])


def resave_tracked(sender, instance, created, raw, **kwargs) -> None:
    """Saves the instance again, marked read: its own change, counted once."""
    if not raw and instance.verb == "read-at-once" and not instance.is_read:
        instance.is_read = True
        instance.save(update_fields=["is_read"])


def resave_whole(sender, instance, created, raw, **kwargs) -> None:
    """Saves every field again, once, with the read state flipped."""
    if not raw and instance.description != "flipped":
        instance.description = "flipped"
        instance.is_read = not instance.is_read
        instance.save()


def change_unsaved(sender, instance, created, raw, **kwargs) -> None:
    """Changes a tracked field of the instance without saving it."""
    instance.is_read = not instance.is_read


RESAVES = {
    "untracked-field": resave_untracked,
    "tracked-field": resave_tracked,
    "whole-row": resave_whole,
    "unsaved-change": change_unsaved,
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", list(RESAVES), ids=list(RESAVES))
def test_creates_with_a_receiver_that_saves_again(make_user, order, kind):
    alice = make_user("alice")
    with receiver(post_save, RESAVES[kind], order):
        for verb in ("v", "read-at-once", "v", "read-at-once"):
            Notification.objects.create(recipient=alice, verb=verb)
        Notification.objects.create(recipient=alice, verb="v", is_read=True)
        with transaction.atomic():
            Notification.objects.create(recipient=alice, verb="read-at-once")
            Notification.objects.create(recipient=alice, verb="v")
    assert Notification.objects.count() == 7
    assert_exact(alice)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", list(RESAVES), ids=list(RESAVES))
def test_updates_with_a_receiver_that_saves_again(make_user, order, kind):
    alice, bob = make_user("alice"), make_user("bob")
    rows = [Notification.objects.create(recipient=alice, verb="v") for _ in range(4)]
    with receiver(post_save, RESAVES[kind], order):
        rows[0].is_read = True
        rows[0].save()
        rows[1].recipient = bob
        rows[1].save()
        rows[2].verb = "read-at-once"
        rows[2].save(update_fields=["verb"])
        stale = Notification.objects.get(pk=rows[3].pk)
        Notification.objects.filter(pk=rows[3].pk).mark_all_read()
        stale.save()  # stale: unread again
    assert_exact(alice, bob)


def test_a_receiver_that_saves_again_in_pre_save(make_user):
    alice = make_user("alice")

    def save_first(sender, instance, raw, update_fields, **kwargs) -> None:
        if instance.pk is not None and update_fields is None and instance.verb == "twice":
            instance.verb = "once"
            instance.save(update_fields=["verb", "is_read"])

    for order in ORDERS:
        n = Notification.objects.create(recipient=alice, verb="v")
        with receiver(pre_save, save_first, order):
            n.verb, n.is_read = "twice", True
            n.save()
        assert_exact(alice)


def fail(sender, instance, raw, **kwargs) -> None:
    raise RuntimeError("receiver failed")


@pytest.mark.parametrize("order", ORDERS)
def test_a_raising_receiver_in_autocommit_leaves_no_row_uncounted(make_user, order):
    """Django commits a plain insert before post_save: the row stays, and it counts."""
    alice = make_user("alice")
    with receiver(post_save, fail, order):
        for _ in range(3):
            with pytest.raises(RuntimeError, match="receiver failed"):
                Notification.objects.create(recipient=alice, verb="v")
    assert truth(alice) == Notification.objects.count() == 3
    assert_exact(alice)


@pytest.mark.parametrize("order", ORDERS)
def test_a_raising_receiver_on_an_update_in_autocommit(make_user, order):
    alice = make_user("alice")
    rows = [Notification.objects.create(recipient=alice, verb="v") for _ in range(3)]
    with receiver(post_save, fail, order):
        for n in rows[:2]:
            n.is_read = True
            with pytest.raises(RuntimeError, match="receiver failed"):
                n.save()
    assert_exact(alice)


@pytest.mark.parametrize("order", ORDERS)
def test_a_raising_receiver_in_a_transaction_counts_nothing(make_user, order):
    alice = make_user("alice")
    Notification.objects.create(recipient=alice, verb="v")
    with (
        receiver(post_save, fail, order),
        pytest.raises(RuntimeError, match="receiver failed"),
        transaction.atomic(),
    ):
        Notification.objects.create(recipient=alice, verb="v")
    assert truth(alice) == 1
    assert_exact(alice)
