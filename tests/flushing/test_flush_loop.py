"""The flush loop: bounded batches, drains what was pending, time budget, lease upkeep."""

from __future__ import annotations

from unittest import mock

import pytest

import counters
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.models import FlushBatch
from notifications.models import Notification
from tests.helpers import assert_exact, stored

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.fixture
def one_shard(settings):
    settings.COUNTERS_SHARDS = 1
    settings.COUNTERS_BATCH_SIZE = 7


def test_one_flush_drains_all_pending_in_bounded_batches(one_shard, make_user):
    users = [make_user() for _ in range(30)]
    Notification.objects.notify(users, verb="v")
    result = counters.flush()
    assert (result.batches, result.keys, result.deltas) == (5, 30, 30)  # 7+7+7+7+2
    assert list(FlushBatch.objects.values_list("keys", flat=True).order_by("keys")) == [
        2,
        7,
        7,
        7,
        7,
    ]
    assert [stored(u) for u in users] == [1] * 30


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_flush_stops_at_what_was_pending_when_it_started(one_shard, make_user):
    users = [make_user() for _ in range(14)]
    Notification.objects.notify(users[:7], verb="v")
    real = flusher.apply_batch
    late = iter(users[7:])

    def apply_and_write_more(batch, using, result):
        real(batch, using, result)
        user = next(late, None)
        if user is not None:
            Notification.objects.create(recipient=user, verb="arrives during the flush")

    with mock.patch.object(flusher, "apply_batch", side_effect=apply_and_write_more):
        result = counters.flush()
    assert (result.batches, result.keys) == (1, 7)  # the late arrival waits for the next flush
    assert get_buffer().pending_count(0) == 1
    assert_exact(*users)


def test_time_budget_stops_starting_batches(one_shard, make_user):
    users = [make_user() for _ in range(20)]
    Notification.objects.notify(users, verb="v")
    result = counters.flush(time_budget=1e-9)
    assert result.incomplete is True
    assert result.batches == 0
    assert_exact(*users)


def test_lease_is_extended_while_a_long_flush_runs(one_shard, settings, make_user):
    settings.COUNTERS_LEASE_TIMEOUT = 0.4
    users = [make_user() for _ in range(21)]
    Notification.objects.notify(users, verb="v")
    buffer = get_buffer()
    lease_key = buffer.key(0, "lease")
    real = flusher.apply_batch
    ttls = []

    def slow_apply(batch, using, result):
        import time

        time.sleep(0.25)  # three batches: 0.75 s, longer than the 0.4 s lease
        ttls.append(buffer.client.pttl(lease_key))
        real(batch, using, result)

    with mock.patch.object(flusher, "apply_batch", side_effect=slow_apply):
        result = counters.flush()
    assert result.batches == 3
    assert len(ttls) == 3 and all(ttl > 0 for ttl in ttls), ttls
    assert not buffer.client.exists(lease_key)  # released at the end
    assert_exact(*users)


def test_zero_sum_deltas_are_never_applied(make_user):
    alice = make_user()
    n = Notification.objects.create(recipient=alice, verb="v")
    n.delete()
    result = counters.flush()
    assert (result.batches, result.keys) == (0, 0)
    assert FlushBatch.objects.count() == 0
    assert_exact(alice)


def test_deltas_of_a_deleted_user_are_dropped_not_applied(make_user):
    alice, bob = make_user(), make_user()
    Notification.objects.create(recipient=alice, verb="v")
    Notification.objects.create(recipient=bob, verb="v")
    counters.add("unread", alice.pk, 1)  # by hand: the cascade below does not take it back
    alice_pk = alice.pk
    alice.delete()  # cascades to her notification (counted -1); the +1 by hand is still buffered
    result = counters.flush()
    assert result.dropped == 1
    assert FlushBatch.objects.filter(dropped=1).count() == 1
    assert counters.get_value("unread", alice_pk) == 0
    assert_exact(bob)
