"""Poison isolation under faults: a flusher that dies at any step of narrowing or
quarantining a batch leaves nothing applied twice, lost, or counted twice by reads."""

from __future__ import annotations

from unittest import mock

import pytest
from django.db import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError

import counters
from counters.base.exceptions import BufferUnavailable, FlushFailed
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.flushing import epoch
from counters.flushing import shard as flusher
from counters.models import FlushBatch
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

#: Sorts after every "unread:<digits>", so the first half of its batch is good.
POISON = "unread:abc"


@pytest.fixture
def one_shard(settings):
    settings.COUNTERS_SHARDS = 1


@pytest.fixture
def users(one_shard, make_user):
    """Eight users with unread notifications, and a poison delta, all in one shard."""
    users = [make_user() for _ in range(8)]
    for i, user in enumerate(users):
        for _ in range(i + 1):
            Notification.objects.create(recipient=user, verb="v")
    get_buffer().push({POISON: 5}, "poison")
    return users


def once(real, fail_when, error: Exception):
    """A stand-in for method ``real`` that raises ``error`` the first time ``fail_when`` holds."""
    state = {"failed": False}

    def method(self, *args, **kwargs):
        if not state["failed"] and fail_when(*args, **kwargs):
            state["failed"] = True
            raise error
        return real(self, *args, **kwargs)

    return method


def killed(message: str) -> RedisConnectionError:
    return RedisConnectionError(f"flusher killed {message}")


CRASHES = [
    pytest.param(  # the flush acknowledges a batch with the move of the next one
        "move",
        once(
            Buffer.move,
            lambda *args, ack=None, **kwargs: ack is not None and "/" in ack,
            killed("after COMMIT"),
        ),
        BufferUnavailable,
        id="after-a-narrowed-batch-committed",
    ),
    pytest.param(
        "narrow",
        once(Buffer.narrow, lambda *a: True, killed("while narrowing")),
        BufferUnavailable,
        id="while-narrowing",
    ),
    pytest.param(
        "quarantine",
        once(Buffer.quarantine, lambda *a: True, killed("while quarantining")),
        BufferUnavailable,
        id="while-quarantining",
    ),
]


def sole_inflight() -> str | None:
    ids = get_buffer().inflight_ids()
    return ids.get(0)


def check_everything(users) -> None:
    """Each good delta applied once, the poison quarantined once, nothing left in Redis."""
    buffer = get_buffer()
    assert [(u.pk, stored(u)) for u in users] == [(u.pk, truth(u)) for u in users]
    assert sum(FlushBatch.objects.values_list("deltas", flat=True)) == sum(map(truth, users))
    assert [(e.member, e.delta) for e in buffer.quarantined()] == [(POISON, 5)]
    assert (buffer.inflight_ids(), buffer.pending_count(0)) == ({}, 0)
    assert [UnreadCounter.objects.get_count(u) for u in users] == [truth(u) for u in users]


@pytest.mark.parametrize(("method", "dying", "raised"), CRASHES)
def test_a_flusher_dying_mid_isolation_applies_nothing_twice(users, method, dying, raised):
    with mock.patch.object(Buffer, method, dying), pytest.raises(raised):
        counters.flush()
    batch_id = sole_inflight()
    assert batch_id is not None, "the batch it worked on stays in flight"
    applied_before = set(FlushBatch.objects.values_list("batch_id", flat=True))
    if method == "move":
        assert batch_id in applied_before  # committed, not acknowledged
    else:
        assert batch_id not in applied_before
    # Reads neither miss nor double count what the dead flusher left.
    assert [UnreadCounter.objects.get_count(u) for u in users] == [truth(u) for u in users]
    result = counters.flush()
    assert result.recovered == 1
    assert result.already_applied == (1 if method == "move" else 0)
    assert result.quarantined == 1
    assert applied_before <= set(FlushBatch.objects.values_list("batch_id", flat=True))
    check_everything(users)
    again = counters.flush()
    assert (again.batches, again.quarantined, again.recovered) == (0, 0, 0)
    check_everything(users)


def test_a_lock_timeout_in_a_narrowed_batch_keeps_it_in_flight(users):
    real = flusher.apply_batch

    def locked(batch, using, result):
        if "/" in batch.batch_id:
            raise OperationalError("canceling statement due to lock timeout")
        return real(batch, using, result)

    with mock.patch.object(flusher, "apply_batch", locked), pytest.raises(FlushFailed) as info:
        counters.flush()
    assert info.value.errors == {0: "canceling statement due to lock timeout"}
    batch_id = sole_inflight()
    assert batch_id is not None and "/" in batch_id
    assert not FlushBatch.objects.filter(pk=batch_id).exists()
    assert get_buffer().quarantined() == []
    assert [UnreadCounter.objects.get_count(u) for u in users] == [truth(u) for u in users]
    assert counters.flush().recovered == 1
    check_everything(users)


def test_narrowed_batch_ids_stay_short_and_carry_their_root(users):
    seen: list[str] = []
    real = flusher.apply_batch

    def spy(batch, using, result):
        seen.append(batch.batch_id)
        return real(batch, using, result)

    with mock.patch.object(flusher, "apply_batch", spy):
        counters.flush()
    roots = {b for b in seen if "/" not in b}
    narrowed = [b for b in seen if "/" in b]
    assert narrowed and all(b.partition("/")[0] in roots for b in narrowed)
    assert max(len(b) for b in seen) <= FlushBatch._meta.get_field("batch_id").max_length
    check_everything(users)


def test_an_unexpected_error_in_one_shard_does_not_skip_the_others(settings, make_user):
    settings.COUNTERS_SHARDS = 4
    users = [make_user() for _ in range(16)]
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
    buffer = get_buffer()
    broken = buffer.shard_of(f"unread:{users[0].pk}")
    real = epoch.check_epoch

    def check(buf, shard, using="default"):
        if shard == broken:
            raise RuntimeError("a bug in one shard")
        return real(buf, shard, using)

    with mock.patch.object(flusher, "check_epoch", check), pytest.raises(FlushFailed) as info:
        counters.flush()
    assert info.value.errors == {broken: "a bug in one shard"}
    healthy = [u for u in users if buffer.shard_of(f"unread:{u.pk}") != broken]
    assert len(healthy) < len(users)
    assert [stored(u) for u in healthy] == [truth(u) for u in healthy] == [1] * len(healthy)
    assert stored(users[0]) == 0
    counters.flush()
    assert [stored(u) for u in users] == [truth(u) for u in users]
