"""``awatch``: a live counter's exact value at once, then after every change.

Each change goes through its own path: a push (the push script publishes),
a direct write when Redis is down, a repair by a rebuild, a discard of
quarantined deltas (published after them). Every value a watcher sees is
checked against SQL or the exact read. Runs on a single Redis and a Redis
Cluster (``redis_backend``), on Valkey under ``TALLY_REDIS_SERVER=valkey``.
A restart of Redis under a watcher loses nothing but time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis
from asgiref.sync import sync_to_async
from django.db import connections

import counters
from counters.base.exceptions import NotLive
from counters.buffer import live
from counters.buffer.cluster import ClusterClient
from counters.client import get_buffer
from counters.read.watch import Dispatcher
from counters.write.fallback import write_direct
from notifications.models import Notification
from tests.helpers import truth
from tests.read.test_async_reads import quarantine

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.live]

#: Seconds a change may take to reach a watcher here (the target is well under one).
WAIT = 5.0


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``scenario`` in an event loop of its own, as an ASGI server runs a view."""

    async def main() -> Any:
        try:
            return await scenario()
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(main())


def in_thread(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    """``fn(*args)`` in a thread of its own (another writer than the loop's reads), its
    database connections closed after it."""

    def call() -> Any:
        try:
            return fn(*args)
        finally:
            connections.close_all()

    return sync_to_async(call, thread_sensitive=False)()


async def until(watch: AsyncIterator[int], expected: Callable[[], int]) -> int:
    """The watcher's values until one equals ``expected()`` (read by SQL in a thread)."""
    deadline = time.monotonic() + WAIT
    while True:
        want = await in_thread(expected)
        value = await asyncio.wait_for(anext(watch), max(0.01, deadline - time.monotonic()))
        if value == want:
            return value


def notify(user, verb: str = "event") -> Notification:
    return Notification.objects.create(recipient=user, verb=verb)


@pytest.mark.usefixtures("redis_backend")
def test_a_watcher_sees_every_change_by_push_direct_write_rebuild_and_discard(make_user):
    alice, bob = make_user(), make_user()
    notify(alice)

    async def scenario() -> None:
        watch = counters.awatch("unread", alice.pk)
        try:
            assert await asyncio.wait_for(anext(watch), WAIT) == 1 == await in_thread(truth, alice)
            # A push, from another thread (another writer).
            await in_thread(notify, alice)
            assert await until(watch, lambda: truth(alice)) == 2
            n = await in_thread(lambda: Notification.objects.filter(recipient=alice).first())
            await in_thread(n.mark_read)
            assert await until(watch, lambda: truth(alice)) == 1
            # A direct write (the path taken when Redis is down): published after COMMIT.
            member = f"unread:{alice.pk}"
            assert await in_thread(write_direct, {member: 5}, "default")
            assert await until(watch, lambda: 6) == 6
            # The rebuild repairs the drift through the delta path.
            await in_thread(lambda: counters.rebuild("unread", keys=[alice.pk], confirm_delay=0.05))
            assert await until(watch, lambda: truth(alice)) == 1
            # A quarantined delta counts until it is discarded: the count then lacks it.
            await in_thread(counters.flush)
            await in_thread(notify, alice)
            assert await until(watch, lambda: truth(alice)) == 2
            await in_thread(quarantine, alice)
            await in_thread(discard_quarantine)
            assert await until(watch, lambda: counters.get_value("unread", alice.pk)) == 1
            await in_thread(lambda: counters.rebuild("unread", confirm_delay=0.05))
            assert await until(watch, lambda: truth(alice)) == 2
            # Bob's changes wake nobody here: the next value is alice's next one.
            await in_thread(notify, bob)
            await in_thread(notify, alice)
            assert await asyncio.wait_for(anext(watch), WAIT) == 3
        finally:
            await watch.aclose()

    run(scenario)


def discard_quarantine() -> None:
    from counters.ops.run import settle_quarantine

    assert settle_quarantine(get_buffer(), "default", retry=False, discard=True) == (0, 1)


def test_many_watchers_share_one_connection_which_closes_with_the_last(make_user):
    users = [make_user() for _ in range(20)]

    async def scenario() -> None:
        watches = [counters.awatch("unread", u.pk) for u in users for _ in range(5)]
        assert [await anext(w) for w in watches] == [0] * 100
        dispatcher = Dispatcher.of(get_buffer())
        assert dispatcher.connections == 1
        assert dispatcher.connects == 1
        await in_thread(notify, users[7])
        got = await asyncio.wait_for(asyncio.gather(*(anext(w) for w in watches[35:40])), WAIT)
        assert got == [1] * 5
        for w in watches:
            await w.aclose()
        await asyncio.sleep(0.05)
        assert dispatcher.connections == 0

    run(scenario)


def subscribers(member: str) -> int:
    """How many connections Redis has subscribed to ``member``'s channel (on its node)."""
    buffer = get_buffer()
    name = live.channel(buffer.prefix, buffer.shard_of(member), member)
    client = buffer.client
    if isinstance(client, ClusterClient):
        node = client.get_node_from_key(name)
        with redis.Redis(host=node.host, port=node.port) as server:
            return int(server.execute_command("PUBSUB", "SHARDNUMSUB", name)[1])
    return int(client.execute_command("PUBSUB", "SHARDNUMSUB", name)[1])


async def until_subscribers(member: str, count: int) -> None:
    deadline = time.monotonic() + WAIT
    while await in_thread(subscribers, member) != count:
        assert time.monotonic() < deadline, f"{member}: never {count} subscribers"
        await asyncio.sleep(0.02)


@pytest.mark.usefixtures("redis_backend")
def test_a_watcher_of_one_key_is_sent_nothing_of_another_keys_changes(make_user):
    alice, bob = make_user(), make_user()
    bobs = f"unread:{bob.pk}"

    async def scenario() -> None:
        watch = counters.awatch("unread", alice.pk)
        try:
            assert await asyncio.wait_for(anext(watch), WAIT) == 0
            dispatcher = Dispatcher.of(get_buffer())
            (event,) = dispatcher.watchers[f"unread:{alice.pk}"]
            # Bob's changes, by pushes and a direct write: his channel has no subscriber.
            for _ in range(3):
                await in_thread(notify, bob)
            assert await in_thread(write_direct, {bobs: 2}, "default")
            assert await in_thread(subscribers, bobs) == 0
            await asyncio.sleep(0.2)
            assert dispatcher.messages == 0 and not event.is_set()
            # Alice's change: one message, one read, her exact value.
            await in_thread(notify, alice)
            assert await asyncio.wait_for(anext(watch), WAIT) == 1 == await in_thread(truth, alice)
            await asyncio.sleep(0.2)
            assert dispatcher.messages == 1 and not event.is_set()
        finally:
            await watch.aclose()
        assert await in_thread(counters.get_value, "unread", bob.pk) == 5

    run(scenario)


@pytest.mark.usefixtures("redis_backend")
def test_watchers_of_one_key_share_one_subscription_and_the_last_to_leave_ends_it(make_user):
    alice, bob = make_user(), make_user()
    alices, bobs = f"unread:{alice.pk}", f"unread:{bob.pk}"

    async def scenario() -> None:
        first, second, of_bob = (counters.awatch("unread", u.pk) for u in (alice, alice, bob))
        try:
            assert [await anext(w) for w in (first, second, of_bob)] == [0, 0, 0]
            dispatcher = Dispatcher.of(get_buffer())
            assert await in_thread(subscribers, alices) == 1 == await in_thread(subscribers, bobs)
            connections = dispatcher.connections
            await in_thread(notify, alice)
            got = await asyncio.wait_for(asyncio.gather(anext(first), anext(second)), WAIT)
            assert got == [1, 1] and dispatcher.messages == 1  # one message wakes both
            await first.aclose()
            await asyncio.sleep(0.2)
            assert await in_thread(subscribers, alices) == 1
            await second.aclose()  # the last watcher of alice: her channel is left
            await until_subscribers(alices, 0)
            assert await in_thread(subscribers, bobs) == 1
            assert dispatcher.connections == connections  # bob still watched, on it
            await in_thread(notify, alice)
            await in_thread(notify, bob)
            assert await asyncio.wait_for(anext(of_bob), WAIT) == 1
            await asyncio.sleep(0.2)
            assert dispatcher.messages == 2
            # A watcher of alice again: subscribed again, her value read then.
            again = counters.awatch("unread", alice.pk)
            try:
                assert await asyncio.wait_for(anext(again), WAIT) == 2
                assert await in_thread(subscribers, alices) == 1
                await in_thread(notify, alice)
                assert await asyncio.wait_for(anext(again), WAIT) == 3
            finally:
                await again.aclose()
        finally:
            for watch in (first, second, of_bob):
                await watch.aclose()
        await asyncio.sleep(0.05)
        assert dispatcher.connections == 0
        await until_subscribers(bobs, 0)

    run(scenario)


def test_a_watcher_that_comes_as_the_last_one_leaves_keeps_the_subscription(make_user):
    alice, bob = make_user(), make_user()
    alices = f"unread:{alice.pk}"

    async def scenario() -> None:
        of_bob = counters.awatch("unread", bob.pk)  # keeps the dispatcher connected
        first = counters.awatch("unread", alice.pk)
        try:
            assert [await asyncio.wait_for(anext(w), WAIT) for w in (of_bob, first)] == [0, 0]
            dispatcher = Dispatcher.of(get_buffer())
            await first.aclose()  # the last watcher of alice leaves, and in this turn
            second = counters.awatch("unread", alice.pk)  # another comes: nothing to send
            try:
                assert await asyncio.wait_for(anext(second), WAIT) == 0
                assert dispatcher.ready[alices].is_set() and dispatcher.connects == 1
                assert await in_thread(subscribers, alices) == 1
                await in_thread(notify, alice)
                assert await asyncio.wait_for(anext(second), WAIT) == 1
            finally:
                await second.aclose()
        finally:
            await first.aclose()
            await of_bob.aclose()

    run(scenario)


def test_a_counter_that_is_not_live_cannot_be_watched_and_costs_no_publish(make_user, monkeypatch):
    monkeypatch.setattr(live, "LIVE_COUNTERS", set())
    alice = make_user()

    async def watch() -> None:
        await anext(counters.awatch("unread", alice.pk))

    with pytest.raises(NotLive, match="track"):
        run(watch)
    buffer = get_buffer()
    plan = buffer.plan_push({f"unread:{alice.pk}": 1, f"unread:{alice.pk + 1}": 1}, "w1:1")
    assert all(len(keys) == 4 for keys, _ in plan.calls)  # no channel, no count
    assert buffer.plan_push({f"unread:{alice.pk}": 1}, "w1:2").wire is not None
    assert buffer._live_keys_cache == {}


@pytest.mark.serial
def test_a_restart_of_redis_mid_watch_makes_the_value_right_again(own_redis, make_user):
    alice = make_user()
    notify(alice)

    async def scenario() -> None:
        await in_thread(counters.flush)
        watch = counters.awatch("unread", alice.pk)
        try:
            assert await asyncio.wait_for(anext(watch), WAIT) == 1
            dispatcher = Dispatcher.of(get_buffer())
            await in_thread(own_redis.kill)
            # Written while Redis is down: to the DB directly, its announcement lost.
            await in_thread(notify, alice)
            assert await in_thread(truth, alice) == 2
            await in_thread(own_redis.start)
            # Subscribed again, every watcher reads again: the value is right.
            assert await until(watch, lambda: truth(alice)) == 2
            assert dispatcher.connects == 2
            await in_thread(notify, alice)
            assert await until(watch, lambda: truth(alice)) == 3
        finally:
            await watch.aclose()

    run(scenario)


def test_a_push_publishes_each_live_member_on_its_own_channel_once_applied(
    redis_client, counters_prefix
):
    from counters.buffer.store import Buffer

    buffer = Buffer(redis_client, f"{counters_prefix}:one", shards=1)
    deltas = {"other:1": 4, "unread:1": 1, "other:2": -1, "unread:2": -2}
    plan = buffer.plan_push(deltas, "w1:1")
    ((keys, args),) = plan.calls
    assert keys[4] == live.channel_base(buffer.prefix, 0) == f"{buffer.prefix}:{{s0}}:live:"
    assert args[4:] == [2, "unread:1", 1, "unread:2", -2, "other:1", 4, "other:2", -1]
    channels = {m: live.channel(buffer.prefix, 0, m) for m in deltas}
    pubsub = redis_client.pubsub()
    try:
        for channel in channels.values():
            pubsub.ssubscribe(channel)
            assert pubsub.get_sharded_message(timeout=1)["type"] == "ssubscribe"
        assert buffer.push(deltas, "w1:1") == {0}
        got = [pubsub.get_sharded_message(timeout=1) for _ in range(2)]
        assert [(m["channel"], m["data"]) for m in got] == [
            (channels["unread:1"].encode(), b""),
            (channels["unread:2"].encode(), b""),
        ]
        assert pubsub.get_sharded_message(timeout=0.2) is None  # "other" is not live
        assert buffer.push(deltas, "w1:1") == set()  # a repeat adds and announces nothing
        assert pubsub.get_sharded_message(timeout=0.2) is None
        # Live members alone: the arguments of any push, the channels' start as a fourth
        # key; one member's push is encoded as fast as any other's.
        ((both_keys, both_args),) = buffer.plan_push({"unread:1": 1, "unread:2": 1}, "w1:2").calls
        assert both_keys == keys and both_args[3:] == [2, "unread:1", 1, "unread:2", 1]
        plan = buffer.plan_push({"unread:2": 2}, "w1:2")
        assert plan.wire is not None and plan.calls[0][0] == keys
        assert buffer.push({"unread:2": 2}, "w1:2") == {0}
        message = pubsub.get_sharded_message(timeout=1)
        assert message["channel"] == channels["unread:2"].encode()
        assert pubsub.get_sharded_message(timeout=0.2) is None
        deltas["unread:2"] = 0
        pending = redis_client.zrange(buffer.key(0, "pending"), 0, -1, withscores=True)
        assert {m.decode(): int(score) for m, score in pending} == {
            m: d for m, d in deltas.items() if d
        }
    finally:
        pubsub.close()
