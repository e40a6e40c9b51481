"""An unread count never reads below zero; a key read below zero is repaired by the next flush."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from django.test import Client

import counters
from counters import api, registry, repair
from counters.status import gather
from notifications.apps import UNREAD_COUNTER
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
]


@pytest.fixture(autouse=True)
def quick(settings, monkeypatch):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # rebuilds confirm drift 0.6 s apart
    monkeypatch.setattr(repair, "_warned", set())  # warnings once per key: this test's own


def below_zero_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "below zero" in r.getMessage()]


def queued() -> set[bytes]:
    buffer = api.get_buffer()
    return buffer.client.smembers(f"{buffer.prefix}:repair")


def test_mark_read_on_a_zeroed_counter_reads_0_and_the_next_flush_repairs_it(make_user, caplog):
    alice, bob = make_user(), make_user()
    note = Notification.objects.create(recipient=alice, verb="v")
    Notification.objects.create(recipient=bob, verb="v")
    counters.flush()
    UnreadCounter.objects.filter(user=alice).update(count=0)  # drift: raw SQL, a lost delta
    assert note.mark_read() is True
    assert counters.get_parts(UNREAD_COUNTER, [alice.pk]) == {alice.pk: (0, -1)}

    client = Client()
    client.force_login(alice)
    with caplog.at_level(logging.WARNING, logger="counters.repair"):
        assert client.get("/api/notifications/unread-count/").json() == {"unread": 0}
        page = client.get("/notifications/").content.decode()
        assert "<title>Notifications · Tally</title>" in page
        assert UnreadCounter.objects.get_count(alice) == 0
        assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 0, bob.pk: 1}
    assert below_zero_warnings(caplog) == [
        f"counter unread at {alice.pk} reads -1, below zero: showing 0 and queueing it for repair"
    ]
    assert queued() == {f"unread:{alice.pk}".encode()}
    assert gather(api.get_buffer())["repair_queue"] == 1

    result = counters.flush()
    assert result.repaired == 1
    assert "1 queued keys repaired" in result.summary()
    assert queued() == set()
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 0
    assert_exact(alice, bob)
    assert [stored(alice), stored(bob)] == [0, 1]


def test_a_moment_below_zero_is_not_repaired(make_user, caplog):
    """A decrement that reached Redis before its increment: the repair finds nothing to do."""
    alice = make_user()
    counters.add(UNREAD_COUNTER, alice.pk, -1)  # the -1 of a mark_read whose +1 is late
    assert UnreadCounter.objects.get_count(alice) == 0
    counters.add(UNREAD_COUNTER, alice.pk, +1)
    Notification.objects.create(recipient=alice, verb="its row")
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 1
    result = counters.flush()
    assert (result.repaired, queued()) == (0, set())
    assert_exact(alice)


def test_counts_that_may_go_negative_are_left_alone(make_user, monkeypatch):
    """Only counters registered ``non_negative`` are clamped."""
    spec = dataclasses.replace(registry.get_spec(UNREAD_COUNTER), non_negative=False)
    monkeypatch.setitem(registry._registry, UNREAD_COUNTER, spec)
    alice = make_user()
    counters.add(UNREAD_COUNTER, alice.pk, -2)
    assert UnreadCounter.objects.get_count(alice) == -2
    assert queued() == set()
