"""Watching live counters: ``awatch(name, key)`` yields a key's exact value on every change.

A live counter (``track(..., live=True)``) has each change of a member
announced on the member's own shard channel (:mod:`counters.buffer.live`): by
the push script for pushes, after COMMIT for direct writes and discards. A
message carries no value: a watcher woken by one re-reads the exact value
(:func:`counters.read.values.get_values`, in the event loop's shared thread
pool, one read for all the watchers an announcement wakes), so a lost message
makes a value late, never wrong.

One :class:`Dispatcher` per event loop and buffer holds the subscriptions:
one connection per Redis node (one for a single Redis, one per master of a
Redis Cluster that holds shards), however many watchers it serves, subscribed
with ``SSUBSCRIBE`` to the channels of the members watched, each once: with
the first watcher of a member, and ``SUNSUBSCRIBE`` when its last one leaves.
So Redis writes a change to the processes that watch it, and to no other. It
wakes the watchers of each member announced, and every watcher whenever its
connections are made again (after Redis restarted, a failover, a network
cut), since announcements may have been missed meanwhile. It closes its
connections when its last watcher leaves. Redis 7 and Valkey have shard
channels; on Redis 6.2 plain channels serve (a single Redis or Sentinel).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncGenerator
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, DatabaseError, close_old_connections
from redis.asyncio import Redis as AsyncRedis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from counters.base import conf
from counters.base.exceptions import NotLive
from counters.base.registry import get_spec
from counters.buffer import live
from counters.buffer.cluster import ClusterClient
from counters.buffer.connections import HEALTH_CHECK_INTERVAL
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.read.batch import Batched
from counters.read.subscriber import Node, node_shards, sharded
from counters.read.values import get_values

logger = logging.getLogger(__name__)

#: Seconds between two attempts to subscribe again while Redis is unreachable (at most).
RECONNECT_MAX_S = 2.0
#: Seconds a new watcher waits for the subscription before its first read, at most.
SUBSCRIBE_WAIT_S = 1.0
#: Seconds a watcher whose read failed waits before it reads again (unless woken sooner).
READ_RETRY_S = 1.0


async def awatch(name: str, key: Any, *, using: str | None = None) -> AsyncGenerator[int, None]:
    """The exact value of counter ``name`` at ``key``: at once, then after every change.

    Changes close together may come as one value (the newest), and a value may
    repeat (a +1 and a -1 between two reads). While Redis or the database is
    unreachable the watcher waits, and reads again as soon as the dispatcher's
    connection is back. Raises :class:`NotLive` for a counter that is not live,
    and :class:`~counters.base.exceptions.InvalidKey` for a key it cannot have.

    The process subscribes to the key's own channel
    (``<prefix>:{sN}:live:<name>:<key>``) while it has watchers of the key, once
    for all of them, on one connection per Redis node for all keys: Redis sends
    a change only to the processes that watch its key.
    """
    spec = get_spec(name)
    if name not in live.LIVE_COUNTERS:
        raise NotLive(name)
    member = spec.member(key)
    alias = using or DEFAULT_DB_ALIAS
    dispatcher = Dispatcher.of(get_buffer(alias))
    event = dispatcher.add(member)
    try:
        # The first value is read once the member's channel is subscribed to, and every node
        # is (unless Redis is slow to answer): no change falls between the two, and the wake
        # of every watcher when the last node is subscribed comes before this first read.
        await _wait_all((dispatcher.ready[member], dispatcher.subscribed), SUBSCRIBE_WAIT_S)
        while True:
            event.clear()  # before the read: a change made during it wakes us again
            try:
                value = await _read(name, key, alias)
            except (RedisError, DatabaseError) as exc:
                logger.info("watch of %s: read failed, waiting: %s", member[:200], exc)
                await _wait(event, READ_RETRY_S)
                continue
            yield value
            await event.wait()
    finally:
        dispatcher.remove(member, event)


def _exact_values(wanted: list[tuple[str, Any, str]]) -> dict[tuple[str, Any, str], int]:
    """The exact values of ``wanted`` ((name, key, alias) each), read together: one
    :func:`~counters.read.values.get_values` per counter and database, in a thread of the
    loop's shared pool. Each call is a request to Django's connection handling: its
    connections are closed after it unless ``CONN_MAX_AGE`` keeps them."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for name, key, using in wanted:
        groups.setdefault((name, using), []).append(key)
    close_old_connections()
    try:
        out = {}
        for (name, using), keys in groups.items():
            values = get_values(name, keys, using=using)
            out.update({(name, key, using): values[key] for key in keys})
        return out
    finally:
        close_old_connections()


#: The exact values watchers ask for, read together.
_reads: Batched[tuple[str, Any, str], int] = Batched(_exact_values)


async def _read(name: str, key: Any, using: str) -> int:
    return await _reads.get((name, key, using))


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


async def _wait_all(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    async def every() -> None:
        for event in events:
            await event.wait()

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(every(), timeout)


#: The dispatchers of each event loop, by buffer (client, prefix, shards).
_dispatchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, Dispatcher]] = (
    weakref.WeakKeyDictionary()
)


class Dispatcher:
    """The subscriptions of one event loop to the channels of one buffer's watched members
    (see the module)."""

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer
        #: member -> the events of its watchers.
        self.watchers: dict[str, set[asyncio.Event]] = {}
        #: member -> set while its channel is subscribed (for as long as it has watchers).
        self.ready: dict[str, asyncio.Event] = {}
        self.task: asyncio.Task[None] | None = None
        #: Times the subscriptions were made (the first time, and each reconnection).
        self.connects = 0
        #: Redis connections held now (one per node subscribed to).
        self.connections = 0
        #: Announcements received (each names one member watched here).
        self.messages = 0
        #: Set while subscribed on every node.
        self.subscribed = asyncio.Event()
        #: shard -> the connection of its node, while connected.
        self.nodes: dict[int, Node] = {}

    @classmethod
    def of(cls, buffer: Buffer) -> Dispatcher:
        """The running loop's dispatcher of ``buffer``, made at first use."""
        per_loop = _dispatchers.setdefault(asyncio.get_running_loop(), {})
        key = (id(buffer.client), buffer.prefix, buffer.shards)
        dispatcher = per_loop.get(key)
        if dispatcher is None:
            dispatcher = per_loop[key] = cls(buffer)
        return dispatcher

    def add(self, member: str) -> asyncio.Event:
        """A new watcher of ``member``: its event, set on each change. The first watcher of
        a member subscribes to its channel (:attr:`ready` tells when it is)."""
        event = asyncio.Event()
        events = self.watchers.get(member)
        if events is None:
            events = self.watchers[member] = set()
            self.ready[member] = asyncio.Event()
            self._changed(member)
        events.add(event)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
        return event

    def remove(self, member: str, event: asyncio.Event) -> None:
        """A watcher of ``member`` leaves; the last one unsubscribes from its channel."""
        events = self.watchers.get(member)
        if events is not None:
            events.discard(event)
            if not events:
                del self.watchers[member]
                del self.ready[member]
                self._changed(member)
        if not self.watchers and self.task is not None:
            self.task.cancel()  # nobody watches: the connections are closed
            self.task = None

    def _changed(self, member: str) -> None:
        node = self.nodes.get(self.buffer.shard_of(member))
        if node is not None:
            node.changed(member)

    def wake(self, members: list[str] | None = None) -> None:
        """Wake the watchers of ``members`` (all watchers if None)."""
        if members is None:
            groups = list(self.watchers.values())
        else:
            groups = [self.watchers[m] for m in members if m in self.watchers]
        for events in groups:
            for event in events:
                event.set()

    async def _run(self) -> None:
        """Connect, listen, and connect again after any failure, until cancelled (or no
        longer the dispatcher's task: a cancellation can be lost in redis-py's sends)."""
        owner = asyncio.current_task()
        delay = 0.05
        while self.task is owner:
            before = self.connects
            try:
                nodes = await sync_to_async(node_shards, thread_sensitive=False)(self.buffer)
                await self._listen_all(nodes, owner)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down, a slot moved: subscribe again
                logger.info("live counters of %r: subscription lost: %s", self.buffer.prefix, exc)
                if isinstance(self.buffer.client, ClusterClient):
                    await sync_to_async(self.buffer.client.refresh, thread_sensitive=False)()
            # Quickly again after a connection that worked; slower while none does.
            delay = 0.05 if self.connects != before else min(delay * 2, RECONNECT_MAX_S)
            await asyncio.sleep(delay)

    async def _listen_all(self, nodes: dict[str, list[int]], owner: Any) -> None:
        """Connect to every node and subscribe to the channels of the members watched there,
        wake every watcher, then dispatch until one node fails."""
        ready: set[str] = set()
        tasks = [
            asyncio.ensure_future(self._listen(url, shards, ready, len(nodes), owner))
            for url, shards in nodes.items()
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises the failure
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _listen(
        self, url: str, shards: list[int], ready: set[str], nodes: int, owner: Any
    ) -> None:
        """Hold the connection to the node at ``url`` (which serves ``shards``); once every
        node is subscribed to what is watched there (``ready``), wake every watcher."""
        client = AsyncRedis.from_url(
            url,
            socket_connect_timeout=conf.socket_timeout(),
            retry=Retry(NoBackoff(), 0),
            health_check_interval=HEALTH_CHECK_INTERVAL,
        )
        pubsub = client.pubsub()
        self.connections += 1
        node: Node | None = None

        def subscribed() -> None:
            ready.add(url)
            if len(ready) == nodes:  # subscribed everywhere: re-read everything
                self.connects += 1
                self.subscribed.set()
                self.wake()

        try:
            await pubsub.connect()
            node = Node(self, pubsub, await sharded(pubsub.connection), subscribed, owner)
            for shard in shards:
                self.nodes[shard] = node
            mine = set(shards)
            await node.start([m for m in self.watchers if self.buffer.shard_of(m) in mine])
            await node.run()
        finally:
            self.subscribed.clear()
            self.connections -= 1
            if node is not None:
                for shard in shards:
                    if self.nodes.get(shard) is node:
                        del self.nodes[shard]
                node.close()
            await pubsub.aclose()
            await client.aclose()
