"""A Redis at ``maxmemory`` with ``noeviction``: pushes are refused and fall back to the DB,
and the flush still drains every pending delta, exactly once."""

from __future__ import annotations

import logging

import pytest
from django.contrib.auth import get_user_model
from django.db.models import Count, Q
from redis.exceptions import OutOfMemoryError

import counters
from counters.buffer.lease import Lease
from counters.buffer.scripts import flags_supported
from counters.client import get_buffer, get_client
from counters.flushing.result import FlushResult
from counters.models import FlushBatch
from counters.ops.run import record_flush
from notifications.models import Notification, UnreadCounter

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

USERS = 2000


@pytest.fixture
def small_batches(settings):
    settings.COUNTERS_SHARDS = 4
    settings.COUNTERS_BATCH_SIZE = 100


def make_users(n: int) -> list:
    User = get_user_model()
    User.objects.bulk_create([User(username=f"full-{i}") for i in range(n)])
    return list(User.objects.filter(username__startswith="full-").order_by("pk"))


def pending_total() -> int:
    buffer = get_buffer()
    return sum(buffer.pending_count(shard) for shard in range(buffer.shards))


def truth_and_stored() -> tuple[dict[int, int], dict[int, int]]:
    """COUNT(*) of unread notifications per user (SQL), and the stored counter rows."""
    User = get_user_model()
    truth = dict(
        User.objects.filter(username__startswith="full-")
        .annotate(n=Count("notifications", filter=Q(notifications__is_read=False)))
        .values_list("pk", "n")
    )
    rows = dict(UnreadCounter.objects.values_list("user_id", "count"))
    return truth, {pk: rows.get(pk, 0) for pk in truth}


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_full_redis_refuses_pushes_and_is_still_drained_exactly(own_redis, small_batches, caplog):
    assert flags_supported(get_client()), "this Redis must support script flags (Redis 7)"
    users = make_users(USERS)
    # One flush first: Redis allocates its caches (script argument buffers, reply
    # buffers) once, so memory measured later is only the data.
    Notification.objects.notify(users, verb="warm-up")
    counters.flush()
    Notification.objects.notify(users, verb="first")
    Notification.objects.notify(users[::3], verb="second")
    Notification.objects.filter(recipient__in=users[::5], verb="first").mark_all_read()
    pending = pending_total()
    assert pending > USERS // 2
    assert own_redis.fill() > 0

    # Redis is full: a push is refused, and the write path falls back to the DB.
    buffer = get_buffer()
    with pytest.raises(OutOfMemoryError):
        buffer.push({f"unread:{users[0].pk}": 1}, "refused")
    fallbacks = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count()
    Notification.objects.notify(users[:50], verb="while full")
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count() > fallbacks
    assert pending_total() == pending  # nothing reached Redis
    full = own_redis.used_memory()

    # The flush drains it anyway: lease, epoch, move, ack and fences run at maxmemory.
    with caplog.at_level(logging.WARNING, logger="counters"):
        for _ in range(5):
            result = counters.flush()
            if pending_total() == 0 and not buffer.inflight_ids():
                break
    assert pending_total() == 0
    assert buffer.inflight_ids() == {}
    assert result.failed_shards == {}
    truth, stored = truth_and_stored()
    assert stored == truth
    assert sum(truth.values()) > USERS
    assert own_redis.used_memory() < full
    # Every fallback write was settled: its push fenced, nothing taken twice.
    assert not FlushBatch.objects.filter(unsettled__isnull=False).exists()


def test_the_drain_path_scripts_run_at_maxmemory(own_redis, settings):
    settings.COUNTERS_SHARDS = 1
    buffer = get_buffer()
    buffer.push({"unread:1": 2, "unread:2": 3}, "before")
    own_redis.fill()
    lease = Lease(buffer.client, buffer.key(0, "lease"), 30)
    assert lease.acquire() is True
    assert lease.extend() is True
    batch = buffer.move(0, "full-batch", 10)
    assert batch is not None and batch.items == {"unread:1": 2, "unread:2": 3}
    narrowed = buffer.narrow(batch, "full-batch/1", ["unread:2"])
    assert narrowed is not None and narrowed.items == {"unread:1": 2}
    assert buffer.quarantine(narrowed, "Error: kept at maxmemory") is True
    assert buffer.fence(["unread:3"], "some-push") == set()
    assert lease.release() is True
    assert [(e.member, e.delta) for e in buffer.quarantined()] == [("unread:1", 2)]
    assert buffer.client.zscore(buffer.key(0, "pending"), "unread:2") == 3


def test_recording_the_flush_is_skipped_with_a_log_line_at_maxmemory(own_redis, caplog):
    buffer = get_buffer()
    own_redis.fill()
    with caplog.at_level(logging.WARNING, logger="counters.ops.run"):
        record_flush(buffer, FlushResult(batches=3))
    [record] = [r for r in caplog.records if r.name == "counters.ops.run"]
    assert "Redis is at maxmemory: the result of this flush is not recorded" in record.getMessage()
    assert "flushed 3 batches" in record.getMessage()
    assert not buffer.client.exists(f"{buffer.prefix}:last_flush")
