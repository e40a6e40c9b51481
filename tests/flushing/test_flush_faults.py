"""Exactly-once flush: a flusher that fails at any point never loses or doubles a batch."""

from __future__ import annotations

import threading
from unittest import mock

import pytest
from django.db import OperationalError, connection
from redis.exceptions import ConnectionError as RedisConnectionError

import counters
from counters.base import conf
from counters.base.exceptions import BufferUnavailable, FlushFailed
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.flushing.result import FlushResult
from counters.flushing.shard import apply_batch
from counters.models import FlushBatch
from notifications.models import Notification, UnreadCounter
from tests.conftest import has_row_locks
from tests.helpers import assert_exact, stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
]


@pytest.fixture
def users_with_notifications(make_user):
    users = [make_user() for _ in range(5)]
    for i, user in enumerate(users):
        for _ in range(i + 1):
            Notification.objects.create(recipient=user, verb="v")
    Notification.objects.filter(recipient=users[0]).first().mark_read()
    return users


def inflight_ids() -> dict[int, str]:
    return get_buffer().inflight_ids()


def test_flush_that_dies_after_the_move_is_recovered_by_the_next(users_with_notifications):
    users = users_with_notifications
    with (
        mock.patch.object(flusher, "apply_deltas", side_effect=OperationalError("boom")),
        pytest.raises(FlushFailed),
    ):
        counters.flush()
    assert inflight_ids(), "the batch must stay in flight"
    assert FlushBatch.objects.count() == 0
    assert [stored(u) for u in users] == [0] * 5
    assert_exact(*users, flush=False)  # in-flight deltas are still counted
    result = counters.flush()
    assert result.recovered >= 1
    assert inflight_ids() == {}
    assert [stored(u) for u in users] == [truth(u) for u in users] == [0, 2, 3, 4, 5]


def test_flush_that_dies_after_commit_before_ack_is_not_applied_twice(users_with_notifications):
    users = users_with_notifications
    with (
        mock.patch.object(Buffer, "ack", side_effect=RedisConnectionError("killed before ack")),
        pytest.raises(BufferUnavailable),
    ):
        counters.flush()
    # One batch per lane of the flush (COUNTERS_FLUSH_LANES) was applied when Redis went.
    batch_ids = list(inflight_ids().values())
    assert 1 <= len(batch_ids) <= conf.flush_lanes()
    assert FlushBatch.objects.filter(pk__in=batch_ids).count() == len(batch_ids)
    applied = [stored(u) for u in users]
    assert sum(applied) > 0
    # the applied in-flight batches are not counted twice by reads
    assert_exact(*users, flush=False)
    result = counters.flush()
    assert result.already_applied == len(batch_ids)
    assert inflight_ids() == {}
    assert FlushBatch.objects.filter(pk__in=batch_ids).count() == len(batch_ids)
    assert_exact(*users)


def test_flush_that_dies_mid_transaction_applies_nothing_then_everything(
    users_with_notifications,
):
    users = users_with_notifications
    from counters.write import apply as apply_module

    real = apply_module.apply_spec

    def half_then_fail(spec, keyed, using):
        real(spec, dict(list(keyed.items())[:2]), using)
        raise OperationalError("connection lost mid-transaction")

    with (
        mock.patch.object(apply_module, "apply_spec", side_effect=half_then_fail),
        pytest.raises(FlushFailed),
    ):
        counters.flush()
    assert [stored(u) for u in users] == [0] * 5, "the partial updates were rolled back"
    assert FlushBatch.objects.count() == 0
    assert_exact(*users)


def test_second_flush_of_an_applied_batch_only_acknowledges(users_with_notifications):
    users = users_with_notifications
    counters.flush()
    batches = FlushBatch.objects.count()
    result = counters.flush()
    assert (result.batches, result.keys) == (0, 0)
    assert FlushBatch.objects.count() == batches
    assert_exact(*users)


@pytest.mark.skipif(not has_row_locks(), reason="needs row locks between connections")
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_two_appliers_of_one_batch_apply_it_once(make_user):
    """A lease that expired mid-apply: both flushers hold the batch; the ledger lets one win."""
    users = [make_user() for _ in range(3)]
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
    buffer = get_buffer()
    batches = [b for s in range(buffer.shards) if (b := buffer.move(s, f"b{s}", 1000))]
    barrier = threading.Barrier(2)
    results = [FlushResult() for _ in range(2)]
    errors = []

    def apply_all(result):
        try:
            for batch in batches:
                barrier.wait(timeout=10)
                apply_batch(batch, "default", result)
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=apply_all, args=(r,)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert sum(r.batches for r in results) == len(batches)
    assert sum(r.already_applied for r in results) == len(batches)
    assert [stored(u) for u in users] == [1, 1, 1]


def test_concurrent_flushes_share_the_shards_through_leases(make_user):
    users = [make_user() for _ in range(20)]
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
    buffer = get_buffer()
    from counters.buffer.lease import Lease

    held = Lease(buffer.client, buffer.key(0, "lease"), 30)
    assert held.acquire()
    try:
        result = counters.flush()
        assert 0 in result.busy_shards
    finally:
        held.release()
    counters.flush()
    assert UnreadCounter.objects.count() == 20
    assert_exact(*users)


def test_a_failing_shard_does_not_hold_up_the_others(make_user):
    users = [make_user() for _ in range(12)]
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
    buffer = get_buffer()
    poisoned = buffer.shard_of(f"unread:{users[0].pk}")
    real = flusher.apply_deltas

    def fail_one_shard(deltas, using):
        if any(buffer.shard_of(member) == poisoned for member in deltas):
            raise OperationalError("canceling statement due to lock timeout")
        return real(deltas, using)

    with (
        mock.patch.object(flusher, "apply_deltas", side_effect=fail_one_shard),
        pytest.raises(FlushFailed) as info,
    ):
        counters.flush()
    assert info.value.errors == {poisoned: "canceling statement due to lock timeout"}
    healthy = [u for u in users if buffer.shard_of(f"unread:{u.pk}") != poisoned]
    assert info.value.result.keys == len(healthy)
    assert [stored(u) for u in healthy] == [1] * len(healthy)
    assert stored(users[0]) == 0
    assert_exact(*users)
