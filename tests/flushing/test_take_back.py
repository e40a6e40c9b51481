"""settle_fallbacks takes back a late push even when Redis refuses the take-back push:
a pending sum near 2**53, or Redis at maxmemory. The take-back goes to the DB once."""

from __future__ import annotations

from unittest import mock

import pytest
from django.db import OperationalError

import counters
from counters.buffer.pushids import PushId
from counters.client import get_buffer
from counters.flushing import settle
from counters.flushing.settle import settle_fallbacks
from counters.models import FALLBACK_PREFIX, FlushBatch
from counters.write.delivery import write_direct
from notifications.apps import UNREAD_COUNTER
from tests.helpers import stored

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

PUSH_ID = PushId("late-push", 7)


def exact(user) -> int:
    [(row, buffered)] = counters.get_parts(UNREAD_COUNTER, [user.pk]).values()
    return row + buffered


def late_push_landed(user, delta: int) -> str:
    """A direct write whose push timed out, and that push reaching Redis afterwards."""
    member = f"unread:{user.pk}"
    write_direct({member: delta}, "default", push_id=PUSH_ID, unsettled=True)
    get_buffer().push({member: delta}, PUSH_ID)
    return member


def test_a_take_back_beyond_exact_scores_is_written_to_the_db(make_user):
    alice = make_user()
    member = late_push_landed(alice, 5)
    buffer = get_buffer()
    # Later pushes bring the pending sum to 3 - 2**53: taking back 5 would leave the exact range.
    for i, delta in enumerate([-(2**52), -(2**52), -2]):
        buffer.push({member: delta}, f"later-{i}")
    truth = 5 - 2**52 - 2**52 - 2  # the direct write once, and the later pushes
    assert (stored(alice), exact(alice)) == (5, truth)  # the read counts the late push once

    assert settle_fallbacks(buffer) == 1
    undo = FlushBatch.objects.get(pk=f"{FALLBACK_PREFIX}{PUSH_ID.undo()}")
    assert (undo.kind, undo.unsettled, undo.keys, undo.deltas) == (
        FlushBatch.Kind.FALLBACK,
        None,
        1,
        5,
    )
    assert not FlushBatch.objects.filter(unsettled__isnull=False).exists()
    assert stored(alice) == 0  # 5 written directly, 5 taken back directly
    shard = buffer.shard_of(member)
    assert buffer.client.zscore(buffer.key(shard, "pending"), member) == 3 - 2**53
    assert exact(alice) == truth

    # Settling again (a flush that died before clearing the row would) takes nothing twice.
    assert settle.take_back(buffer, {member: -5}, PUSH_ID.undo(), "default") is True
    assert settle_fallbacks(buffer) == 0
    counters.flush()
    assert stored(alice) == exact(alice) == truth


def test_a_take_back_refused_by_a_full_redis_is_written_to_the_db(own_redis, make_user):
    alice, bob = make_user(), make_user()
    late_push_landed(alice, 4)
    get_buffer().push({f"unread:{bob.pk}": 2}, "bob")
    own_redis.fill()
    result = counters.flush()
    assert result.compensated == 1
    assert FlushBatch.objects.filter(pk=f"{FALLBACK_PREFIX}{PUSH_ID.undo()}").exists()
    assert (stored(alice), stored(bob)) == (4, 2)
    assert (exact(alice), exact(bob)) == (4, 2)
    assert not FlushBatch.objects.filter(unsettled__isnull=False).exists()


def test_a_take_back_whose_db_write_failed_is_made_once_later(own_redis, make_user):
    alice = make_user()
    late_push_landed(alice, 4)
    own_redis.fill()
    buffer = get_buffer()
    with mock.patch("counters.write.apply.apply_deltas", side_effect=OperationalError("db hiccup")):
        assert settle_fallbacks(buffer) == 0  # refused by Redis, then by the DB
    assert FlushBatch.objects.filter(unsettled__isnull=False).count() == 1
    own_redis.limit_memory(0)  # room again; the take-back push id is fenced by now
    assert settle_fallbacks(buffer) == 1
    assert FlushBatch.objects.filter(pk=f"{FALLBACK_PREFIX}{PUSH_ID.undo()}").exists()
    counters.flush()
    assert stored(alice) == exact(alice) == 4
