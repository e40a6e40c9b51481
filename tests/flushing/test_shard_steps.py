"""The steps of one shard's flush (``ShardFlush``), each tested against the invariant its
docstring states, on the real Redis and the real database."""

from __future__ import annotations

import time
from unittest import mock

import pytest
from django.db import OperationalError

import counters
from counters.flushing import shard as flusher
from counters.flushing.result import FlushResult
from counters.flushing.shard import ShardFlush
from counters.models import FlushBatch
from tests.helpers import stored

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.fixture
def buffer(settings):
    settings.COUNTERS_SHARDS = 1
    return counters.get_buffer()


def steps(buffer, *, budget: float = 30.0, batch_size: int = 1000) -> ShardFlush:
    """A flush of shard 0 that has begun (epoch checked), as :meth:`ShardFlush.run` begins it."""
    flush = ShardFlush(
        buffer,
        0,
        using="default",
        batch_size=batch_size,
        lease_timeout=30.0,
        deadline=time.monotonic() + budget,
        result=FlushResult(),
    )
    flush.begin()
    return flush


def unread(*users) -> dict[str, int]:
    return {f"unread:{u.pk}": 1 for u in users}


def test_begin_counts_what_is_pending_and_starts_from_the_sequence_the_db_applied(
    buffer, make_user
):
    users = [make_user() for _ in range(3)]
    buffer.push(unread(*users), "first")
    counters.flush()
    buffer.push(unread(*users[:2]), "second")
    flush = steps(buffer)
    assert (flush.target, flush.applied_seq) == (2, 1)
    assert flush.result.lost_shards == []


def test_move_takes_pending_into_flight_under_a_new_id_and_acknowledges_the_last_applied(
    buffer, make_user
):
    alice, bob = make_user(), make_user()
    buffer.push(unread(alice), "first")
    flush = steps(buffer)
    first = flush.move()
    assert first is not None and not first.recovered
    assert first.items == unread(alice)
    assert buffer.pending_count(0) == 0
    assert buffer.inflight_ids() == {0: first.batch_id}
    assert flush.apply(first)
    flush.unacked = first.batch_id
    buffer.push(unread(bob), "second")
    second = flush.move()
    assert second is not None and second.batch_id != first.batch_id
    assert second.items == unread(bob)
    assert buffer.inflight_ids() == {0: second.batch_id}  # the first is acknowledged
    assert flush.unacked is None
    third = flush.move()  # the second is still in flight, not acknowledged: no third batch
    assert third is not None and third.recovered and third.batch_id == second.batch_id
    assert flush.result.recovered == 1


def test_move_returns_the_batch_already_in_flight_as_recovered_and_moves_nothing(buffer, make_user):
    alice, bob = make_user(), make_user()
    buffer.push(unread(alice), "first")
    dead = buffer.move(0, "moved-by-a-dead-flusher", 1000)  # never applied nor acknowledged
    buffer.push(unread(bob), "second")
    flush = steps(buffer)
    batch = flush.move()
    assert batch is not None and batch.recovered
    assert (batch.batch_id, batch.items) == (dead.batch_id, unread(alice))
    assert buffer.pending_count(0) == 1  # bob waits for the next move
    assert flush.result.recovered == 1


def test_apply_commits_the_counter_updates_and_the_ledger_row_together(buffer, make_user):
    alice = make_user()
    buffer.push({f"unread:{alice.pk}": 3}, "first")
    flush = steps(buffer)
    batch = flush.move()
    assert batch is not None
    with (
        mock.patch.object(flusher, "apply_deltas", side_effect=OperationalError("db gone")),
        pytest.raises(OperationalError),
    ):
        flush.apply(batch)  # the ledger row went first: rolled back with the updates
    assert not FlushBatch.objects.filter(pk=batch.batch_id).exists()
    assert stored(alice) == 0
    assert buffer.inflight_ids() == {0: batch.batch_id}  # in flight as it was
    assert flush.apply(batch)
    assert FlushBatch.objects.filter(pk=batch.batch_id).exists()
    assert stored(alice) == 3
    assert flush.applied_seq == batch.seq
    assert (flush.result.batches, flush.result.keys, flush.result.deltas) == (1, 1, 3)


def test_apply_replays_a_recovered_batch_only_if_the_ledger_lacks_it(buffer, make_user):
    alice = make_user()
    buffer.push(unread(alice), "first")
    first = steps(buffer)
    batch = first.move()
    assert batch is not None and first.apply(batch)  # then the flusher dies: no acknowledge
    again = steps(buffer)
    recovered = again.move()
    assert recovered is not None and recovered.recovered
    assert recovered.batch_id == batch.batch_id
    assert again.apply(recovered)
    assert (again.result.batches, again.result.already_applied) == (0, 1)
    assert stored(alice) == 1  # not twice
    again.unacked = recovered.batch_id
    again.acknowledge()
    assert buffer.inflight_ids() == {}


def test_isolate_narrows_a_failed_batch_and_sends_its_other_half_back(buffer, make_user):
    users = [make_user() for _ in range(4)]
    buffer.push(unread(*users), "first")
    flush = steps(buffer)
    batch = flush.move()
    assert batch is not None
    flush.isolate(batch, ValueError("poison"))
    members = sorted(batch.items)
    assert flush.narrowed is not None
    assert sorted(flush.narrowed.items) == members[:2]  # kept in flight, applied next
    assert flush.returned == [members[2:]]  # moved next, by themselves
    assert buffer.inflight_ids() == {0: flush.narrowed.batch_id}
    assert buffer.pending_count(0) == 2
    assert flush.result.quarantined == 0


def test_isolate_quarantines_the_member_that_cannot_be_applied_and_applies_the_rest(
    buffer, make_user
):
    users = [make_user() for _ in range(5)]
    buffer.push({**unread(*users), "unread:abc": 2}, "first")  # a key its field cannot hold
    flush = steps(buffer)
    flush.run()
    assert flush.result.quarantined == 1
    assert [(e.member, e.delta) for e in buffer.quarantined()] == [("unread:abc", 2)]
    assert [stored(u) for u in users] == [1] * 5
    assert buffer.pending_count(0) == 0
    assert buffer.inflight_ids() == {}


def test_acknowledge_drops_the_batch_in_flight_only_while_its_id_matches(buffer, make_user):
    alice = make_user()
    buffer.push(unread(alice), "first")
    flush = steps(buffer)
    batch = flush.move()
    assert batch is not None and flush.apply(batch)
    flush.unacked = "a-batch-another-flusher-replaced"
    flush.acknowledge()
    assert buffer.inflight_ids() == {0: batch.batch_id}  # not this flusher's to drop
    flush.unacked = batch.batch_id
    flush.acknowledge()
    assert buffer.inflight_ids() == {}
    assert flush.unacked is None


def test_may_go_on_stops_starting_batches_once_the_budget_is_spent(buffer, make_user):
    buffer.push(unread(make_user()), "first")
    flush = steps(buffer, budget=0.0)
    assert not flush.may_go_on()
    assert flush.result.incomplete is True
    flush.drain()
    assert buffer.pending_count(0) == 1  # nothing moved
