"""The async reads give exactly what their sync twins give, from an event loop.

Each read here runs in an event loop of its own with no sync thread above it,
as an async view runs under an ASGI server: the sync read raises
``SynchronousOnlyOperation`` there. Every part of the value is set up for
real (a stored row, pending deltas, a batch in flight, a batch applied but
not yet acknowledged, quarantined deltas) and checked against SQL.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from unittest import mock

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.contrib.auth import get_user_model
from django.core.exceptions import SynchronousOnlyOperation
from django.db import connections, transaction

import counters
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.flushing.result import FlushResult
from counters.write.apply import apply_deltas
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def in_loop(read: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
    """``await read(*args, **kwargs)`` in a new event loop of this thread, as an async view.

    The thread the read hops to (asgiref's own, there being no outer sync
    thread) closes its database connections before the loop ends.
    """

    async def main() -> Any:
        try:
            return await read(*args, **kwargs)
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(main())


def member(user) -> str:
    return f"unread:{user.pk}"


def users_in_distinct_shards(make_user, count: int) -> list:
    """``count`` users whose unread counters fall in ``count`` different shards."""
    shard_of = get_buffer().shard_of
    users: dict[int, Any] = {}
    while len(users) < count:
        user = make_user()
        users.setdefault(shard_of(member(user)), user)
    return list(users.values())


def quarantine(user) -> None:
    """Fault: the flush of ``user``'s batch fails, so its deltas go to the quarantine."""

    def failing(items, using):  # type: ignore[no-untyped-def]
        if member(user) in items:
            raise ValueError("injected: this batch cannot be applied")
        return apply_deltas(items, using)

    with mock.patch.object(flusher, "apply_deltas", failing):
        assert counters.flush().quarantined == 1


def move_pending(user, *, apply: bool) -> None:
    """Move the pending set of ``user``'s shard into flight; ``apply``: the flusher then
    applies it (the ledger has the batch) and dies before acknowledging it."""
    buffer = get_buffer()
    shard = buffer.shard_of(member(user))
    batch = buffer.move(shard, uuid.uuid4().hex, 1000)
    assert batch is not None and member(user) in batch.items
    if apply:
        flusher.apply_batch(batch, "default", FlushResult())


def parts(user) -> dict[str, int]:
    buffer = get_buffer()
    snap = buffer.snapshot([member(user)])
    return {
        "stored": stored(user),
        "pending": snap.pending[member(user)],
        "inflight": snap.inflight[member(user)],
        "quarantined": snap.quarantined[member(user)],
    }


@pytest.mark.usefixtures("redis_backend")
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_every_part_of_the_value_reads_as_the_sync_read_does(make_user):
    quarantined, in_flight, applied, pending, flushed = users_in_distinct_shards(make_user, 5)
    Notification.objects.notify([quarantined, flushed], verb="first")
    quarantine(quarantined)
    Notification.objects.notify([flushed, in_flight, applied], verb="second")
    counters.flush()
    Notification.objects.notify([in_flight, applied], verb="third")
    move_pending(in_flight, apply=False)
    move_pending(applied, apply=True)
    Notification.objects.notify([pending, applied], verb="fourth")
    Notification.objects.filter(recipient=flushed).first().mark_read()
    assert parts(quarantined) == {"stored": 0, "pending": 0, "inflight": 0, "quarantined": 1}
    assert parts(in_flight)["inflight"] == 1 and parts(applied)["inflight"] == 1
    assert parts(applied)["stored"] == 2 and parts(applied)["pending"] == 1
    assert parts(pending) == {"stored": 0, "pending": 1, "inflight": 0, "quarantined": 0}
    assert parts(flushed)["pending"] == -1
    users = [quarantined, in_flight, applied, pending, flushed]
    expected = {u.pk: truth(u) for u in users}
    assert expected == {
        quarantined.pk: 1,
        in_flight.pk: 2,
        applied.pk: 3,
        pending.pk: 1,
        flushed.pk: 1,
    }
    for user in users:
        assert in_loop(counters.aget_value, "unread", user.pk) == expected[user.pk]
        assert in_loop(UnreadCounter.objects.aget_count, user) == expected[user.pk]
        assert counters.get_value("unread", user.pk) == expected[user.pk]
    ids = [u.pk for u in users]
    assert in_loop(counters.aget_values, "unread", ids, using=None) == expected
    assert in_loop(UnreadCounter.objects.aget_counts, users) == expected
    assert counters.get_values("unread", ids) == expected
    counters.flush()  # recovers both batches in flight; the quarantine stays
    assert in_loop(counters.aget_values, "unread", ids) == expected
    assert {u.pk: stored(u) for u in users} == {**expected, quarantined.pk: 0}


def test_the_sync_read_refuses_an_event_loop_where_the_async_read_answers(make_user):
    alice = make_user()
    Notification.objects.notify([alice], verb="v")

    async def sync_read_in_the_loop() -> int:
        return UnreadCounter.objects.get_count(alice)

    with pytest.raises(SynchronousOnlyOperation):
        in_loop(sync_read_in_the_loop)
    assert in_loop(UnreadCounter.objects.aget_count, alice) == truth(alice) == 1


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_an_async_read_inside_a_transaction_sees_its_uncommitted_deltas(make_user):
    """The read runs in the thread that holds the transaction open (thread-sensitive), so it
    adds the deltas the transaction has recorded and not sent: read-your-writes."""
    alice = make_user()
    Notification.objects.notify([alice], verb="committed")
    aget_count = async_to_sync(UnreadCounter.objects.aget_count)
    with transaction.atomic():
        Notification.objects.create(recipient=alice, verb="uncommitted")
        Notification.objects.create(recipient=alice, verb="uncommitted")
        assert parts(alice)["pending"] == 1  # the two are not in Redis yet
        assert aget_count(alice) == UnreadCounter.objects.get_count(alice) == truth(alice) == 3
        transaction.set_rollback(True)
    assert aget_count(alice) == truth(alice) == 1


def test_keys_may_be_a_queryset_and_come_back_as_given(make_user):
    alice, bob = make_user(), make_user()
    Notification.objects.notify([alice, bob], verb="v")
    users = get_user_model().objects.filter(pk__in=[alice.pk, bob.pk])  # evaluated in the thread
    assert in_loop(UnreadCounter.objects.aget_counts, users) == {alice.pk: 1, bob.pk: 1}
    Notification.objects.create(recipient=bob, verb="w")
    ids = get_user_model().objects.filter(pk=bob.pk).values_list("pk", flat=True)
    assert in_loop(counters.aget_values, "unread", ids) == {bob.pk: 2}
    # "7" and 7 read one counter; each answer is keyed as it was asked
    assert in_loop(counters.aget_value, "unread", str(bob.pk)) == 2
    assert in_loop(counters.aget_values, "unread", [str(bob.pk), bob.pk]) == {
        str(bob.pk): 2,
        bob.pk: 2,
    }
    assert in_loop(counters.aget_values, "unread", []) == {} == counters.get_values("unread", [])


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_with_redis_unreachable_the_async_read_falls_back_like_the_sync_one(make_user, settings):
    alice = make_user()
    Notification.objects.notify([alice, alice], verb="v")
    counters.flush()
    settings.COUNTERS_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    Notification.objects.filter(recipient=alice).first().mark_read()  # written to the row
    assert in_loop(UnreadCounter.objects.aget_count, alice) == truth(alice) == 1
    assert UnreadCounter.objects.get_count(alice) == stored(alice) == 1


def test_an_unknown_counter_raises_as_the_sync_read_does():
    with pytest.raises(counters.UnknownCounter):
        counters.get_value("no_such_counter", 1)
    with pytest.raises(counters.UnknownCounter):
        in_loop(counters.aget_value, "no_such_counter", 1)
