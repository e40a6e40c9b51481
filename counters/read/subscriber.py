"""A watching process's subscriber connection to one Redis node, and where each shard's
channels are served.

A :class:`Node` is subscribed to the channels of the members watched in its
node's shards (:mod:`counters.buffer.live`), each once, for the
:class:`~counters.read.watch.Dispatcher` that owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import RedisError, ResponseError

from counters.base import conf
from counters.buffer import live
from counters.buffer.cluster import ClusterClient
from counters.buffer.connections import HEALTH_CHECK_INTERVAL, redis_scheme
from counters.buffer.store import Buffer


class Watchers(Protocol):
    """What a :class:`Node` needs of the dispatcher it serves."""

    buffer: Buffer
    #: The dispatcher's current task: a node whose owner it no longer is ends.
    task: Any
    #: member -> set once the member's channel is subscribed to.
    ready: dict[str, asyncio.Event]
    #: member -> its watchers.
    watchers: dict[str, Any]
    #: Messages read, over all nodes.
    messages: int

    def wake(self, members: list[str] | None = None) -> None: ...


class Node:
    """The connection of a dispatcher to one Redis node, subscribed to the channels
    of the members watched in the node's shards: a member's channel is subscribed to with its
    first watcher and unsubscribed from with its last. One task sends the commands, another
    reads their replies and the messages."""

    def __init__(
        self,
        dispatcher: Watchers,
        pubsub: Any,
        sharded: bool,
        subscribed: Callable[[], None],
        owner: Any,
    ) -> None:
        self.dispatcher = dispatcher
        #: The dispatcher's task this connection serves: it ends when that task is replaced.
        self.owner = owner
        self.pubsub = pubsub
        self.sharded = sharded
        #: Called once, when the channels watched at :meth:`start` are subscribed to.
        self.subscribed: Callable[[], None] | None = subscribed
        #: channel -> member, for the channels subscribed to (the last command sent).
        self.members: dict[str, str] = {}
        #: channel -> its commands not confirmed yet, in order (True: subscribe).
        self.unconfirmed: dict[str, deque[bool]] = {}
        #: Members whose first watcher came or last watcher went since the last commands.
        self.todo: set[str] = set()
        self.kick = asyncio.Event()
        self.closed = False
        #: Channels of :meth:`start` not confirmed yet.
        self.waiting: set[str] = set()

    def changed(self, member: str) -> None:
        self.todo.add(member)
        self.kick.set()

    async def start(self, members: list[str]) -> None:
        """Subscribe to the channels of ``members``, watched when the connection was made."""
        self.todo.update(members)
        self.waiting = {self._channel(m) for m in members}
        await self._send()
        self._check_subscribed()

    async def run(self) -> None:
        """Read replies and messages, and send the commands the watchers ask for, until the
        connection fails."""
        sender = asyncio.ensure_future(self._sender())
        try:
            while self.dispatcher.task is self.owner:
                if sender.done():
                    sender.result()  # raises its failure
                message = await self.pubsub.get_message(timeout=HEALTH_CHECK_INTERVAL)
                if message is not None:
                    self._read(message)
        finally:
            # (A cancellation may be lost in a send that completes as it arrives: the sender
            # also stops at its next turn.)
            self.closed = True
            self.kick.set()
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await sender

    def close(self) -> None:
        """The connection is gone, and every subscription with it."""
        ready = self.dispatcher.ready
        for member in self.members.values():
            if member in ready:
                ready[member].clear()

    def _channel(self, member: str) -> str:
        buffer = self.dispatcher.buffer
        return live.channel(buffer.prefix, buffer.shard_of(member), member)

    def _check_subscribed(self) -> None:
        subscribed = self.subscribed
        if subscribed is not None and not self.waiting:
            self.subscribed = None
            subscribed()

    async def _sender(self) -> None:
        while True:
            await self.kick.wait()
            if self.closed:
                return
            self.kick.clear()
            await self._send()
            self._check_subscribed()

    async def _send(self) -> None:
        """Subscribe to the channels of the members that gained their first watcher, and
        unsubscribe from those of the members that lost their last one: one command per
        shard and direction (a cluster takes one slot a command)."""
        todo, self.todo = self.todo, set()
        dispatcher = self.dispatcher
        commands: dict[tuple[bool, int], list[str]] = {}
        for member in todo:
            channel = self._channel(member)
            wanted = member in dispatcher.watchers
            if wanted == (channel in self.members):  # a watcher left and another came
                if wanted and channel not in self.unconfirmed:
                    dispatcher.ready[member].set()
                continue
            if wanted:
                self.members[channel] = member
            else:
                del self.members[channel]
                self.waiting.discard(channel)
            self.unconfirmed.setdefault(channel, deque()).append(wanted)
            commands.setdefault((wanted, dispatcher.buffer.shard_of(member)), []).append(channel)
        connection = self.pubsub.connection
        for (wanted, _), channels in commands.items():
            if wanted:
                command = "SSUBSCRIBE" if self.sharded else "SUBSCRIBE"
            else:
                command = "SUNSUBSCRIBE" if self.sharded else "UNSUBSCRIBE"
            # Sent as is, never waiting for a reply: the reader reads it with the messages.
            await connection.send_command(command, *channels, check_health=False)

    def _read(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind in ("smessage", "message"):
            self.dispatcher.messages += 1
            member = self.members.get(_text(message["channel"]))
            if member is not None:
                self.dispatcher.wake([member])
            return
        if kind not in ("ssubscribe", "subscribe", "sunsubscribe", "unsubscribe"):
            return
        channel = _text(message["channel"])
        subscribing = kind in ("ssubscribe", "subscribe")
        pending = self.unconfirmed.get(channel)
        if not pending or pending[0] != subscribing:
            if not subscribing and channel in self.members:  # the slot moved away (cluster)
                raise RedisError(f"unsubscribed from {channel}")
            return
        pending.popleft()
        if pending:
            return
        del self.unconfirmed[channel]
        member = self.members.get(channel)
        if member is not None:  # subscribed: the member's first read may be made
            self.dispatcher.ready[member].set()
            self.waiting.discard(channel)
            self._check_subscribed()


async def sharded(connection: Any) -> bool:
    """Whether the server has shard channels (Redis 7, Valkey): else plain ones serve."""
    await connection.send_command("PUBSUB", "SHARDNUMSUB")
    try:
        await connection.read_response()
    except ResponseError:
        return False
    return True


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def node_shards(buffer: Buffer) -> dict[str, list[int]]:
    """The shards of ``buffer`` by the URL of the Redis node that serves their channels."""
    shards = list(range(buffer.shards))
    client = buffer.client
    url = redis_scheme(conf.redis_url())
    if isinstance(client, ClusterClient):
        by_node: dict[str, list[int]] = {}
        first = redis_scheme(client.urls[0])
        for shard in shards:
            node = client.get_node_from_key(live.channel_base(buffer.prefix, shard))
            by_node.setdefault(_at(first, node.host, node.port), []).append(shard)
        return by_node
    pool = client.connection_pool
    master = getattr(pool, "get_master_address", None)  # through Sentinel
    if master is not None:
        host, port = master()
        return {_at(url, host, port): shards}
    return {url: shards}


def _at(url: str, host: str, port: int) -> str:
    """``url`` (its scheme, credentials, database, options) at ``host:port``."""
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@{host}:{port}" if credentials else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))
