"""A flush drains shards in lanes: threads of their own, one batch's statements at a time."""

from __future__ import annotations

import threading
import time
from unittest import mock

import pytest
from django.db import connection, connections, transaction
from redis.exceptions import ConnectionError as RedisConnectionError

import counters
from counters.base.exceptions import BufferUnavailable
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.flushing.lanes import Lanes, flush_buffer
from counters.models import FlushBatch
from notifications.models import Notification
from tests.helpers import assert_exact, stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
]


class ApplySpy:
    """Wraps a batch's statement (``apply_deltas`` in ``apply_batch``): the threads it ran in,
    and the most that ran at once."""

    def __init__(self) -> None:
        self.real = flusher.apply_deltas
        self.lock = threading.Lock()
        self.threads: set[str] = set()
        self.running = self.most = 0
        self.batches = 0

    def __call__(self, deltas, using):
        with self.lock:
            self.threads.add(threading.current_thread().name)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return self.real(deltas, using)
        finally:
            with self.lock:
                self.running -= 1
                self.batches += 1


@pytest.fixture
def laned():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has one writer: a flush there keeps to one lane")


@pytest.fixture
def spread(make_user):
    """Users whose counter members fall in many shards, each with a few notifications."""
    users = [make_user() for _ in range(24)]
    for i, user in enumerate(users):
        for _ in range(i % 4 + 1):
            Notification.objects.create(recipient=user, verb="v")
    shards = {get_buffer().shard_of(f"unread:{u.pk}") for u in users}
    assert len(shards) > 2
    return users


@pytest.mark.usefixtures("laned")
def test_two_lanes_drain_every_shard_exactly_one_apply_at_a_time(spread, settings):
    settings.COUNTERS_FLUSH_LANES = 2
    spy = ApplySpy()
    with mock.patch.object(flusher, "apply_deltas", spy):
        result = counters.flush()
    assert spy.threads == {threading.current_thread().name, "counters-flush-lane-1"}
    assert spy.most == 1, "the lanes' batch statements must take turns"
    shards = {get_buffer().shard_of(f"unread:{u.pk}") for u in spread}
    assert result.batches == spy.batches == len(shards)
    assert result.keys == len(spread)
    assert FlushBatch.objects.count() == len(shards)
    assert (
        [stored(u) for u in spread]
        == [truth(u) for u in spread]
        == [i % 4 + 1 for i in range(len(spread))]
    )
    assert get_buffer().inflight_ids() == {}


@pytest.mark.usefixtures("laned")
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_batch_holds_the_turn_for_its_statements_and_commits_after_handing_it_on(make_user):
    """The ledger row and the batch statement run in the turn; the COMMIT beside the next."""
    user = make_user()
    Notification.objects.create(recipient=user, verb="v")
    Notification.objects.create(recipient=user, verb="v")
    buffer = get_buffer()
    shard = buffer.shard_of(f"unread:{user.pk}")
    batch = buffer.move(shard, flusher.new_batch_id(), 100)
    assert batch is not None and batch.items == {f"unread:{user.pk}": 2}
    turn = threading.Lock()
    seen: dict[str, bool] = {}
    real_record, real_apply = flusher.ledger.record_batch, flusher.apply_deltas
    conn = connections["default"]
    real_commit = conn.commit

    def record(batch, using):
        seen["ledger"] = turn.locked()
        return real_record(batch, using)

    def apply(deltas, using):
        seen["statement"] = turn.locked()
        return real_apply(deltas, using)

    def commit():
        seen["commit"] = turn.locked()
        return real_commit()

    result = flusher.FlushResult()
    with (
        mock.patch.object(flusher.ledger, "record_batch", record),
        mock.patch.object(flusher, "apply_deltas", apply),
        mock.patch.object(conn, "commit", commit),
        flusher.taking_turns(turn),
    ):
        flusher.apply_batch(batch, "default", result)
    assert seen == {"ledger": True, "statement": True, "commit": False}
    assert not turn.locked()
    assert (result.batches, result.keys) == (1, 1)
    assert FlushBatch.objects.filter(pk=batch.batch_id).exists()
    assert stored(user) == truth(user) == 2
    assert buffer.ack(shard, batch.batch_id)


@pytest.mark.usefixtures("laned")
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_batch_that_fails_in_its_turn_hands_it_on(make_user):
    user = make_user()
    Notification.objects.create(recipient=user, verb="v")
    buffer = get_buffer()
    shard = buffer.shard_of(f"unread:{user.pk}")
    batch = buffer.move(shard, flusher.new_batch_id(), 100)
    turn = threading.Lock()

    def fail(deltas, using):
        raise RuntimeError("the statement failed")

    with (
        mock.patch.object(flusher, "apply_deltas", fail),
        flusher.taking_turns(turn),
        pytest.raises(RuntimeError, match="the statement failed"),
    ):
        flusher.apply_batch(batch, "default", flusher.FlushResult())
    assert not turn.locked()
    assert not FlushBatch.objects.filter(pk=batch.batch_id).exists()
    assert stored(user) == 0
    assert counters.flush().recovered == 1
    assert stored(user) == truth(user) == 1


def test_a_lane_closes_its_database_connection(spread, settings):
    settings.COUNTERS_FLUSH_LANES = 2
    if connection.vendor != "postgresql":
        pytest.skip("counts the server's sessions")
    ours = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    lanes = []
    real = Lanes._lane_thread

    def lane_thread(self, result):
        lanes.append(connections["default"])
        real(self, result)

    with connection.cursor() as cursor:
        cursor.execute(ours)
        (before,) = cursor.fetchone()
        with mock.patch.object(Lanes, "_lane_thread", lane_thread):
            counters.flush()
        [lane] = lanes
        assert lane is not connections["default"]
        assert lane.connection is None, "the lane's connection must be closed"
        # The server ends the lane's session a moment after the client closed it.
        deadline = time.monotonic() + 10
        while True:
            cursor.execute(ours)
            (after,) = cursor.fetchone()
            if after == before or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert after == before
    assert_exact(*spread)


@pytest.mark.parametrize("lanes", [1, 4])
def test_the_number_of_lanes_is_the_setting(spread, settings, lanes):
    settings.COUNTERS_FLUSH_LANES = lanes
    spy = ApplySpy()
    with mock.patch.object(flusher, "apply_deltas", spy):
        counters.flush()
    if connection.vendor == "sqlite":
        assert spy.threads == {threading.current_thread().name}
    else:
        assert threading.current_thread().name in spy.threads
        assert len(spy.threads) <= lanes
        assert spy.threads <= {threading.current_thread().name} | {
            f"counters-flush-lane-{i}" for i in range(1, lanes)
        }
        if lanes == 1:
            assert spy.threads == {threading.current_thread().name}
    assert spy.most == 1
    assert_exact(*spread)


def test_a_flush_inside_a_transaction_stays_in_its_thread(spread, settings):
    """The lanes' own connections would not see the rows of the caller's transaction."""
    settings.COUNTERS_FLUSH_LANES = 2
    spy = ApplySpy()
    with mock.patch.object(flusher, "apply_deltas", spy), transaction.atomic():
        Notification.objects.create(recipient=spread[0], verb="v")
        counters.flush()  # the new one is pushed at COMMIT: not in this flush
    assert spy.threads == {threading.current_thread().name}
    assert_exact(*spread)


@pytest.mark.usefixtures("laned")
@pytest.mark.usefixtures("laned")
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_shard_failing_before_its_lane_queried_the_database_fails_that_shard_only(
    spread, settings
):
    """A lane's connection that was never opened is not taken for a database gone."""
    settings.COUNTERS_FLUSH_LANES = 2
    real = flusher.check_epoch
    failed = []
    lane_began = threading.Event()

    def check(buffer, shard, using="default"):
        if threading.current_thread().name != "counters-flush-lane-1":
            lane_began.wait(10)  # the calling lane leaves the other one a shard
        elif not failed:
            failed.append(shard)
            lane_began.set()
            raise RuntimeError("a bug in one shard")
        return real(buffer, shard, using)

    with mock.patch.object(flusher, "check_epoch", check):
        result = flush_buffer(get_buffer())
    assert len(failed) == 1
    assert list(result.failed_shards) == failed
    assert "a bug in one shard" in result.failed_shards[failed[0]]
    assert result.keys == len(spread) - sum(
        1 for u in spread if get_buffer().shard_of(f"unread:{u.pk}") == failed[0]
    )
    counters.flush()
    assert [stored(u) for u in spread] == [truth(u) for u in spread]


@pytest.mark.usefixtures("laned")
def test_redis_gone_in_one_lane_stops_the_flush_and_loses_nothing(spread, settings):
    settings.COUNTERS_FLUSH_LANES = 2
    real_move = flusher.ShardFlush.move
    moves = []

    def move_then_fail(self, only=None):
        moves.append(threading.current_thread().name)
        if threading.current_thread().name == "counters-flush-lane-1":
            raise RedisConnectionError("Redis went away")
        return real_move(self, only)

    with (
        mock.patch.object(flusher.ShardFlush, "move", move_then_fail),
        pytest.raises(BufferUnavailable),
    ):
        counters.flush()
    assert "counters-flush-lane-1" in moves
    assert not any(t.name.startswith("counters-flush-lane-") for t in threading.enumerate())
    assert connections["default"].is_usable()
    assert_exact(*spread)  # reads count what is still pending or in flight
    counters.flush()
    assert [stored(u) for u in spread] == [truth(u) for u in spread]
    assert get_buffer().inflight_ids() == {}
