"""Negative counts: counters.write.negatives.clamp on fakeredis (negatives read 0, are warned
once and queued), and on real Redis and the database an unread count never reads below zero and
a key read below zero is repaired by the next flush."""

from __future__ import annotations

import dataclasses
import logging
from unittest import mock

import fakeredis
import pytest
from django.test import Client
from redis import RedisError

import counters
from counters.base import registry
from counters.base.registry import CounterSpec
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.ops.status import gather
from counters.write import negatives as repair
from notifications.apps import UNREAD_COUNTER
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth


@pytest.fixture
def buffer() -> Buffer:
    return Buffer(fakeredis.FakeRedis(server=fakeredis.FakeServer()), "t", shards=2)


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch):
    monkeypatch.setattr(repair, "_warned", set())  # warnings once per key: this test's own


@pytest.fixture
def quick(settings):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # rebuilds confirm drift 0.6 s apart


@pytest.fixture
def spec() -> CounterSpec:
    return CounterSpec("likes", "auth.User", non_negative=True)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "counters.write.negatives"]


def test_negatives_read_0_and_are_queued(spec, buffer, caplog):
    with caplog.at_level(logging.WARNING, logger="counters.write.negatives"):
        values = repair.clamp(spec, {1: -2, 2: 3, 3: 0}, lambda: buffer)
        again = repair.clamp(spec, {1: -1}, lambda: buffer)
    assert (values, again) == ({1: 0, 2: 3, 3: 0}, {1: 0})
    assert buffer.client.smembers("t:repair") == {b"likes:1"}
    assert warnings(caplog) == [
        "counter likes at 1 reads -2, below zero: showing 0 and queueing it for repair"
    ]


def test_a_counter_that_may_go_negative_is_returned_as_read(buffer):
    spec = CounterSpec("balance", "auth.User")
    values = {1: -5}
    assert repair.clamp(spec, values, lambda: buffer) is values
    assert buffer.client.exists("t:repair") == 0


def test_the_memory_of_warned_keys_is_bounded(spec, buffer, monkeypatch, caplog):
    monkeypatch.setattr(repair, "WARNED_LIMIT", 3)
    with caplog.at_level(logging.WARNING, logger="counters.write.negatives"):
        for key in range(1, 6):
            repair.clamp(spec, {key: -1}, lambda: buffer)
        repair.clamp(spec, {1: -1}, lambda: buffer)  # forgotten when the memory was reset
    assert len(repair._warned) <= 3
    assert len(warnings(caplog)) == 6
    assert buffer.client.scard("t:repair") == 5


def test_many_keys_at_once_log_ten_lines_and_a_count(spec, buffer, caplog):
    with caplog.at_level(logging.WARNING, logger="counters.write.negatives"):
        repair.clamp(spec, {key: -1 for key in range(25)}, lambda: buffer)
    lines = warnings(caplog)
    assert len(lines) == 11
    assert lines[-1] == "... and 15 more keys of likes below zero"


def test_a_redis_failure_while_queueing_still_returns_0(spec, buffer, caplog):
    with (
        mock.patch.object(buffer.client, "sadd", side_effect=RedisError("down")),
        caplog.at_level(logging.WARNING, logger="counters.write.negatives"),
    ):
        assert repair.clamp(spec, {7: -1}, lambda: buffer) == {7: 0}
    assert warnings(caplog)[-1] == "could not queue 1 keys of likes for repair: down"


# -- on real Redis and the database -------------------------------------------------


def below_zero_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "below zero" in r.getMessage()]


def queued() -> set[bytes]:
    buffer = get_buffer()
    return buffer.client.smembers(f"{buffer.prefix}:repair")


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.usefixtures("redis_backend", "quick")
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
    with caplog.at_level(logging.WARNING, logger="counters.write.negatives"):
        assert client.get("/api/notifications/unread-count/").json() == {"unread": 0}
        page = client.get("/notifications/").content.decode()
        assert "<title>Notifications · Tally</title>" in page
        assert UnreadCounter.objects.get_count(alice) == 0
        assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 0, bob.pk: 1}
    assert below_zero_warnings(caplog) == [
        f"counter unread at {alice.pk} reads -1, below zero: showing 0 and queueing it for repair"
    ]
    assert queued() == {f"unread:{alice.pk}".encode()}
    assert gather(get_buffer())["repair_queue"] == 1

    result = counters.flush()
    assert result.repaired == 1
    assert "1 queued keys repaired" in result.summary()
    assert queued() == set()
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 0
    assert_exact(alice, bob)
    assert [stored(alice), stored(bob)] == [0, 1]


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.usefixtures("redis_backend", "quick")
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


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.usefixtures("redis_backend", "quick")
def test_counts_that_may_go_negative_are_left_alone(make_user, monkeypatch):
    """Only counters registered ``non_negative`` are clamped."""
    spec = dataclasses.replace(registry.get_spec(UNREAD_COUNTER), non_negative=False)
    monkeypatch.setitem(registry._registry, UNREAD_COUNTER, spec)
    alice = make_user()
    counters.add(UNREAD_COUNTER, alice.pk, -2)
    assert UnreadCounter.objects.get_count(alice) == -2
    assert queued() == set()
