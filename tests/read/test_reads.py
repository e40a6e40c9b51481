"""Reads are consistent or refuse: batches moving during a read, late pushes over direct writes."""

from __future__ import annotations

import uuid

import pytest
from django.db import transaction

import counters
from counters.base.exceptions import InconsistentRead
from counters.buffer.lease import Lease
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.flushing.result import FlushResult
from counters.read import values as reads
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

# One push after each COMMIT: what these tests follow is that push (the sender would merge it).
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
    pytest.mark.usefixtures("per_commit"),
]


def _flush_between_snapshot_and_rows(monkeypatch, times: int, *, holder=None) -> list[int]:
    """Fault: before each of the first ``times`` DB reads, another writer adds +1
    and a flusher applies everything pending; then +1 more is left pending for
    the next reading's snapshot (except after the last).

    Each such reading counts a delta both in its Redis snapshot and in the row.
    ``holder`` flushes as the holder of the shard's lease would (no lease taken).
    """
    original = reads._read_rows
    injected: list[int] = []

    def racing_read_rows(spec, keys, batch_ids, using):
        if len(injected) < times:
            injected.append(1)
            counters.add("unread", keys[0], 1)
            if holder is None:
                counters.flush()
            else:
                buffer, shard = holder
                batch = buffer.move(shard, uuid.uuid4().hex, 1000)
                flusher.apply_batch(batch, using, FlushResult())
                buffer.ack(shard, batch.batch_id)
            if len(injected) < times:  # pending again for the next snapshot
                counters.add("unread", keys[0], 1)
        return original(spec, keys, batch_ids, using)

    monkeypatch.setattr(reads, "_read_rows", racing_read_rows)
    return injected


def exact_now(user) -> int:
    """stored + pending once nothing moves: the value a consistent read must give."""
    member = f"unread:{user.pk}"
    snap = get_buffer().snapshot([member])
    assert snap.inflight_ids == {}
    return stored(user) + snap.pending[member]


def test_a_read_that_keeps_racing_flushes_takes_the_leases(make_user, monkeypatch):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    counters.add("unread", alice.pk, 1)  # pending when the first snapshot is taken
    injected = _flush_between_snapshot_and_rows(monkeypatch, reads.OPTIMISTIC_READINGS)
    value = UnreadCounter.objects.get_count(alice)
    assert len(injected) == reads.OPTIMISTIC_READINGS
    assert value == exact_now(alice) == 1 + 1 + 2 * reads.OPTIMISTIC_READINGS - 1


def test_a_read_refuses_rather_than_guess(make_user, monkeypatch):
    alice = make_user()
    counters.add("unread", alice.pk, 1)
    buffer = get_buffer()
    shard = buffer.shard_of(f"unread:{alice.pk}")
    monkeypatch.setattr(reads, "LEASE_WAIT", 0.3)
    _flush_between_snapshot_and_rows(monkeypatch, 10_000, holder=(buffer, shard))
    # another flusher holds the shard (and, like a flusher, moves batches meanwhile)
    with Lease(buffer.client, buffer.key(shard, "lease"), 30) as busy:
        assert busy.held
        with pytest.raises(InconsistentRead) as raised:
            counters.get_value("unread", alice.pk)
    assert raised.value.shards == [shard]
    assert raised.value.counter == "unread"


def test_late_push_over_a_direct_write_is_counted_once(make_user, monkeypatch):
    from redis.exceptions import TimeoutError as RedisTimeout

    from counters.buffer.store import Buffer

    alice, bob = make_user(), make_user()
    for user in (alice, alice, bob):
        Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    # Fault: Redis stalls, so both attempts of the next push time out unanswered
    # and the deltas are written to the DB directly; the push arrives later.
    original = Buffer.push
    stalled: list[tuple[dict, str]] = []

    def stalled_push(self, deltas, push_id):
        stalled.append((dict(deltas), push_id))
        raise RedisTimeout("Timeout reading from socket")

    monkeypatch.setattr(Buffer, "push", stalled_push)
    with transaction.atomic():
        Notification.objects.filter(recipient=alice).first().delete()
        Notification.objects.create(recipient=bob, verb="w")
    monkeypatch.setattr(Buffer, "push", original)
    assert (stored(alice), stored(bob)) == (1, 2)  # the direct write
    deltas, push_id = stalled[-1]
    assert original(get_buffer(), deltas, push_id)  # the late delivery lands
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 1, bob.pk: 2}
    assert (truth(alice), truth(bob)) == (1, 2)
    assert_exact(alice, bob)  # the flush fences the push and takes it back


def _stall_next_push(monkeypatch) -> list[tuple[dict, object]]:
    """Fault: Redis stalls, so both attempts of the next pushes time out unanswered."""
    from redis.exceptions import TimeoutError as RedisTimeout

    from counters.buffer.store import Buffer

    stalled: list[tuple[dict, object]] = []

    def stalled_push(self, deltas, push_id):
        stalled.append((dict(deltas), push_id))
        raise RedisTimeout("Timeout reading from socket")

    monkeypatch.setattr(Buffer, "push", stalled_push)
    return stalled


def test_late_push_after_the_flush_fenced_it_is_refused(make_user, monkeypatch):
    from counters.buffer import pushids as writers
    from counters.buffer.pushids import PushId
    from counters.buffer.store import Buffer
    from counters.models import FALLBACK_PREFIX, FlushBatch

    alice, bob = make_user(), make_user()
    Notification.objects.create(recipient=alice, verb="v")
    original = Buffer.push
    stalled = _stall_next_push(monkeypatch)
    with transaction.atomic():
        Notification.objects.create(recipient=alice, verb="w")
        Notification.objects.create(recipient=bob, verb="w")
    monkeypatch.setattr(Buffer, "push", original)
    deltas, push_id = stalled[-1]
    assert isinstance(push_id, PushId) and stalled[0][1] == push_id  # the repeat: same id
    row = FlushBatch.objects.get(pk=f"{FALLBACK_PREFIX}{push_id}")
    assert row.unsettled == deltas
    # The writer was retired with its push: the pool never hands it out again.
    assert all(writers.allocate().writer != push_id.writer for _ in range(3))
    counters.flush()  # fences the push: it had not landed
    buffer = get_buffer()
    assert original(buffer, deltas, push_id) == set()  # the late delivery is refused
    assert not FlushBatch.objects.filter(unsettled__isnull=False).exists()
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 2, bob.pk: 1}
    assert (truth(alice), truth(bob)) == (2, 1)
    assert_exact(alice, bob)


def test_late_push_then_a_repeated_settle_takes_it_back_once(make_user, monkeypatch):
    from counters.buffer.store import Buffer
    from counters.flushing import settle
    from counters.models import FALLBACK_PREFIX, FlushBatch

    alice = make_user()
    original = Buffer.push
    stalled = _stall_next_push(monkeypatch)
    Notification.objects.create(recipient=alice, verb="v")
    monkeypatch.setattr(Buffer, "push", original)
    deltas, push_id = stalled[-1]
    buffer = get_buffer()
    assert original(buffer, deltas, push_id)  # the late delivery lands
    assert original(buffer, deltas, push_id) == set()  # and its repeat adds nothing
    assert counters.get_value("unread", alice.pk) == 1  # counted once before settling
    assert settle.settle_fallbacks(buffer) == 1
    # A flush that died before clearing the row settles it again: nothing taken twice.
    FlushBatch.objects.filter(pk=f"{FALLBACK_PREFIX}{push_id}").update(unsettled=deltas)
    assert settle.settle_fallbacks(buffer) == 1
    assert counters.get_value("unread", alice.pk) == 1
    counters.flush()
    assert stored(alice) == truth(alice) == 1
    assert_exact(alice)


def test_writer_marks_grow_with_writers_not_with_pushes(make_user, settings):
    from counters.buffer import pushids as writers
    from counters.write import acks

    users = [make_user() for _ in range(5)]
    buffer = get_buffer()
    for i in range(60):
        Notification.objects.create(recipient=users[i % 5], verb="v")
    idle, busy = writers.pool_size()
    busy += acks.writer_count()  # the writers of this thread's line
    keys = [
        k
        for shard in range(buffer.shards)
        for k in buffer.client.scan_iter(match=buffer.key(shard, "w:*"))
    ]
    assert 1 <= len(keys) <= buffer.shards * (idle + busy)
    assert not list(buffer.client.scan_iter(match=f"{buffer.prefix}:*push:*"))
    counters.flush()
    assert [stored(u) for u in users] == [truth(u) for u in users] == [12] * 5
