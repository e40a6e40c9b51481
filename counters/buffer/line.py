"""A line to one Redis: pushes written in batches, their replies read later, in order.

A push waited on costs the writer a round trip: its thread sleeps until
Redis answers and is woken again, some 60 to 130 µs of CPU. A :class:`Line`
takes the push's scripts (:meth:`Line.send`) and writes them to a connection
of its own with the pushes handed to it before, in one system call
(:meth:`Line.write`); the replies are read later (:meth:`Line.receive`),
oldest first, by which time they have usually arrived, so reading them does
not sleep: the replies that have arrived are taken without waiting for the
others (:meth:`Line.receive_added`). One write of many pushes also costs
Redis one read of its socket for all of them, where a write per push costs
it one each.

The line uses redis-py's public connection API alone: ``connect``,
``send_packed_command`` (one packed write of many pushes, one system call),
``can_read`` and ``read_response``, ``disconnect``.

Redis runs the commands of one connection in the order they were written,
so pushes on a line apply in order, each under its own push id
(:mod:`counters.buffer.pushids`): a reply read late changes nothing of what
the push did. What a failure means is unchanged:

- :class:`~counters.base.exceptions.NotConnected` from :meth:`Line.send`:
  nothing of that push left;
- any other error from :meth:`Line.write` or :meth:`Line.receive`: the
  connection is closed, and every push handed to the line and not yet
  answered may have run. The call raises it; the caller takes the pushes
  back with :meth:`Line.abandon`.

A plain Redis only: a Redis Cluster routes each shard to its own master
(the write path waits on those pushes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from hiredis import pack_command as pack
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from counters.buffer.intake import (
    PUSH_MARKER_TTL_MS,
    PUSH_MAX_AGE_MS,
    Intake,
    PushPlan,
    encode_one,
    push_head,
)

#: Heads of the push scripts' commands kept per line (``EVALSHA``, the sha, the keys).
HEADS_KEPT = 256
#: No reply held (:attr:`Line._early`).
_NONE: Any = object()


class Line:
    """One connection of its own to the Redis of ``buffer``, and the pushes written on it.

    The connection is redis-py's (the client's connection class and settings:
    TLS, a Unix socket, AUTH, the database), opened, written and read by
    redis-py; the replies are read raw (``disable_decoding``), as Redis sent
    them.

    Not thread-safe: its owner serialises the calls.
    """

    def __init__(self, buffer: Intake) -> None:
        client = buffer.client
        if not isinstance(client, Redis):
            raise TypeError("a line needs a plain Redis client (not a cluster)")
        # A connection of the client's pool, outside it: the pool's class and settings (a
        # Sentinel pool's connection asks it for the master). The line never sends a
        # health-check PING on it, so no PING's reply can come in place of a push's.
        self.connection: Any = client.connection_pool.make_connection()
        self.sha: str = buffer._push.sha
        #: Pushes handed to the line whose replies are not read yet, oldest first.
        self.unread: deque[PushPlan] = deque()
        #: How many of them, the newest, are not written yet (:meth:`write`).
        self.queued = 0
        #: The connection failed with pushes unread: :meth:`abandon` them.
        self.broken = False
        #: The connection is open (:meth:`_open`) and has not failed or been closed since.
        self.connected = False
        #: Keys of a push -> the encoded head of its command (:meth:`_packed`).
        self._heads: dict[tuple[str, ...], str] = {}
        #: The encoded commands of the pushes not written yet.
        self._out: list[bytes] = []
        #: The reply of the oldest unread push, read by :meth:`receive_added` and left
        #: for :meth:`receive` (else ``_NONE``); an error reply as its exception.
        self._early: Any = _NONE

    def send(self, plan: PushPlan, now: bool = True) -> None:
        """Write ``plan``'s scripts to the connection, after the pushes taken before, without
        reading their replies; ``now`` False: only take them, to be written with the next
        :meth:`write` (or the read of their reply).

        Raises :class:`~counters.base.exceptions.NotConnected` if the
        connection could not be opened (nothing of it left), else a Redis
        ``ConnectionError`` or ``TimeoutError`` (the line is broken; ``plan``
        is not among the pushes to :meth:`abandon`).
        """
        packed = plan.wire
        if packed is None:
            calls = plan.calls
            if len(calls) == 1:
                packed = self._packed(*calls[0])
            else:
                packed = b"".join([self._packed(keys, args) for keys, args in calls])
        if not self.connected:
            self._open()  # NotConnected: nothing of it left, no push is unread
        if not now:
            self._out.append(packed)
            self.unread.append(plan)
            self.queued += 1
            return
        if self.queued:
            self.write()
        self._send(packed)
        self.unread.append(plan)

    def write(self) -> None:
        """Write the pushes taken and not written yet, in one system call.

        Raises a Redis ``ConnectionError`` or ``TimeoutError`` if the
        connection failed: the line is broken, and every unanswered push may
        have run (:meth:`abandon` them).
        """
        if not self.queued:
            return
        out = self._out
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self.queued = 0
        self._send(data)

    def _send(self, data: bytes) -> None:
        """``data`` written whole (redis-py's ``sendall``, up to the client's timeout)."""
        try:
            if not self.connected:  # pragma: no cover - a line with pushes to write is open
                raise RedisConnectionError("the line is closed")
            self.connection.send_packed_command([data], check_health=False)
        except BaseException:
            self._break()
            raise

    def _packed(self, keys: Sequence[str], args: list) -> bytes:
        """``EVALSHA <sha> <len(keys)> *keys *args``, encoded for Redis (RESP).

        The push of one member (six arguments: the script's four, a member and
        its delta) with its keys as a tuple (:class:`Intake` keeps one per shard
        and writer), all of it ASCII, is encoded here as text, its head (the
        command, the sha and the keys) kept per line; anything else by hiredis.
        Both give the same bytes.
        """
        if len(args) == 6 and type(keys) is tuple:
            ttl, now_ms, max_age, seq, member, delta = args
            if (
                ttl is PUSH_MARKER_TTL_MS
                and max_age is PUSH_MAX_AGE_MS
                and type(member) is str
                and type(now_ms) is type(seq) is type(delta) is int
                and member.isascii()
            ):
                head = self._heads.get(keys)
                if head is None:
                    head = self._head(keys)
                if head:  # "": keys of other characters than ASCII
                    return encode_one(head, now_ms, seq, member, delta)
        return pack(("EVALSHA", self.sha, len(keys), *keys, *args))

    def _head(self, keys: tuple[str, ...]) -> str:
        """The start of a one-member push with ``keys`` as text, through its first argument
        (the same in every push), kept (a few per line); "" if a key is not ASCII (hiredis
        encodes those pushes)."""
        if len(self._heads) >= HEADS_KEPT:
            self._heads.clear()
        head = self._heads[keys] = push_head(self.sha, keys)
        return head

    def receive(self) -> tuple[PushPlan, list[Any]]:
        """The oldest unread push and its replies (a reply may be an error, as a value).

        Raises :class:`NoScriptError` if a shard did not know the script (that
        shard did nothing; repeat the push once the script is loaded), the
        first other error reply of the push, or the error that broke the
        connection (then :meth:`abandon` the pushes still unread). A push not
        written yet is written first, with every push taken after it.
        """
        unread = self.unread
        if len(unread) <= self.queued:
            self.write()
        plan = unread.popleft()
        calls = plan.calls
        try:
            if len(calls) == 1:
                reply = self._early
                if reply is _NONE:
                    reply = self._reply()
                else:
                    self._early = _NONE
                if type(reply) is int:  # a one-shard push's code
                    return plan, [reply]
                replies = [reply]
            else:
                replies = [self._reply() for _ in calls]
        except BaseException:
            self._break()
            raise
        for reply in replies:
            if isinstance(reply, NoScriptError):
                raise reply
            if isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT"):
                raise NoScriptError(str(reply))
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return plan, replies

    def receive_added(self, most: int) -> int:
        """Take the oldest unread pushes off the line, up to ``most``, while each one is a
        push of one shard answered 1 (it added its deltas); how many were taken.

        What :meth:`receive` would return as ``[1]`` for each, without
        waiting for a reply: it stops at a push of several shards, a push not
        written yet, a reply not arrived, any other reply (kept for
        :meth:`receive`), or a failure of the connection (the line is then
        broken, and :meth:`receive` raises it).
        """
        unread, connection = self.unread, self.connection
        most = min(most, len(unread) - self.queued)
        if most <= 0 or self._early is not _NONE or not self.connected:
            return 0
        taken = 0
        try:
            while taken < most and len(unread[0].calls) == 1:
                if not connection.can_read(timeout=0):
                    break  # not arrived yet: receive() waits for it
                reply = self._reply()
                if type(reply) is not int or reply != 1:
                    self._early = reply
                    break
                unread.popleft()
                taken += 1
        except Exception:  # the connection failed: receive() meets it on the closed line
            self._break()
        return taken

    def _reply(self) -> Any:
        """The next reply on the connection, raw; an error reply as its exception."""
        try:
            return self.connection.read_response(disable_decoding=True)
        except ResponseError as exc:  # a reply, not a failure: redis-py raises it
            return exc

    def _open(self) -> None:
        self.connection.connect()
        self.connected = True
        self._early = _NONE

    def abandon(self) -> list[PushPlan]:
        """The pushes written and never answered, taken off the line (it was closed)."""
        plans = list(self.unread)
        self.unread.clear()
        self._early = _NONE
        self._out.clear()
        self.queued = 0
        self.broken = False
        return plans

    def _break(self) -> None:
        self.close()
        self.broken = True

    def close(self) -> None:
        """Close the connection; pushes not written yet are never written."""
        self.connected = False
        self._out.clear()
        self.queued = 0
        self.connection.disconnect()
