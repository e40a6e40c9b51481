"""A line to one Redis: pushes written in batches, their replies read later, in order.

A push waited on costs the writer a round trip: its thread sleeps until
Redis answers and is woken again, some 60 to 130 µs of CPU. A :class:`Line`
takes the push's scripts (:meth:`Line.send`) and writes them to a connection
of its own with the pushes handed to it before, in one system call
(:meth:`Line.write`); the replies are read later (:meth:`Line.receive`),
oldest first, by which time they have usually arrived, so reading them does
not sleep. The usual replies, each push of one shard added (``:1``), are
taken in one call once they have arrived (:meth:`Line.receive_added`). One
write of many pushes also costs Redis one read of its socket for all of
them, where a write per push costs it one each.

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

import socket
from collections import deque
from collections.abc import Sequence
from typing import Any

from hiredis import Reader
from hiredis import pack_command as pack
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from counters.buffer.intake import (
    PUSH_MARKER_TTL_MS,
    PUSH_MAX_AGE_MS,
    Intake,
    PushPlan,
    encode_one,
    push_head,
)

#: Bytes one ``recv`` asks for: the replies of many pushes.
READ_SIZE = 65536
#: As many replies of one-shard pushes that added their deltas (``:1``) as one read can
#: hold: what arrived is all such replies when this run starts with it.
_ADDED_RUN = b":1\r\n" * (READ_SIZE // 4)
#: Heads of the push scripts' commands kept per line (``EVALSHA``, the sha, the keys).
HEADS_KEPT = 256
#: No reply held (:attr:`Line._early`).
_NONE: Any = object()


class Line:
    """One connection of its own to the Redis of ``buffer``, and the pushes written on it.

    The connection is redis-py's (the client's connection class and settings:
    TLS, a Unix socket, AUTH, the database), opened by redis-py; the pushes are
    then written to its socket directly and their replies parsed by a hiredis
    reader of the line's own, without redis-py's per-command work.

    Not thread-safe: its owner serialises the calls.
    """

    def __init__(self, buffer: Intake) -> None:
        client = buffer.client
        if not isinstance(client, Redis):
            raise TypeError("a line needs a plain Redis client (not a cluster)")
        # A connection of the client's pool, outside it: the pool's class and settings (a
        # Sentinel pool's connection asks it for the master). The line never sends through
        # it, so no health-check PING's reply can come in place of a push's.
        self.connection: Any = client.connection_pool.make_connection()
        self.sha: str = buffer._push.sha
        #: Pushes handed to the line whose replies are not read yet, oldest first.
        self.unread: deque[PushPlan] = deque()
        #: How many of them, the newest, are not written yet (:meth:`write`).
        self.queued = 0
        #: The connection failed with pushes unread: :meth:`abandon` them.
        self.broken = False
        self._sock: socket.socket | None = None
        #: The client's socket timeout (None: none), for the calls that must wait.
        self._timeout: float | None = None
        #: ``sendall`` for the socket: :meth:`_sendall` once it is non-blocking.
        self._write_all = _blocking_sendall
        self._reader = Reader(replyError=ResponseError)
        #: Every byte fed to the reader is part of a complete reply: it holds no part of one
        #: (which it may not show: an array's header is taken off its buffer at once).
        self._whole = True
        #: Keys of a push -> the encoded head of its command (:meth:`_packed`).
        self._heads: dict[tuple[str, ...], str] = {}
        #: The encoded commands of the pushes not written yet.
        self._out: list[bytes] = []
        #: The reply of the oldest unread push, parsed by :meth:`receive_added` and left
        #: for :meth:`receive` (else ``_NONE``).
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
        sock = self._sock
        if sock is None:
            sock = self._open()  # NotConnected: nothing of it left, no push is unread
        if not now:
            self._out.append(packed)
            self.unread.append(plan)
            self.queued += 1
            return
        if self.queued:
            self.write()
        try:
            self._write_all(sock, packed)
        except BaseException as exc:
            self._break()
            raise _redis_error(exc, "writing to") from exc
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
        sock = self._sock
        try:
            if sock is None:  # pragma: no cover - a line with pushes queued is open
                raise RedisConnectionError("the line is closed")
            self._write_all(sock, data)
        except BaseException as exc:
            self._break()
            raise _redis_error(exc, "writing to") from exc

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
                    reply = self._reader.gets()  # usually read already, with those before
                    if reply is False:
                        reply = self._reply()
                else:
                    self._early = _NONE
                if type(reply) is int:  # a one-shard push's code
                    return plan, [reply]
                replies = [reply]
            else:
                replies = [self._reply() for _ in calls]
        except BaseException as exc:
            self._break()
            if isinstance(exc, Exception):
                raise _redis_error(exc, "reading from") from exc
            raise
        for reply in replies:
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
        waiting: it stops at a push of several shards, a push not written
        yet, a reply not arrived, any other reply (kept for :meth:`receive`),
        or a failure of the connection (which :meth:`receive` then meets).
        """
        unread, reader = self.unread, self._reader
        most = min(most, len(unread) - self.queued)
        if most <= 0 or self._early is not _NONE:
            return 0
        taken = 0
        read = False
        while taken < most and len(unread[0].calls) == 1:
            reply = reader.gets()
            if reply is False:
                if read:  # the rest have not all arrived: receive() waits for them
                    break
                data = self._arrived()  # once: what has arrived by now, not waited for
                read = True
                if not data:
                    break
                if not self._whole or len(data) % 4 or not _ADDED_RUN.startswith(data):
                    reader.feed(data)  # parsed one by one
                    self._whole = False
                    continue
                # The usual replies alone, from a reply's start: one ``:1`` per push.
                left = taken + len(data) // 4  # ``taken`` with a push for each of them
                ready = min(left, most)
                while taken < ready and len(unread[0].calls) == 1:
                    unread.popleft()
                    taken += 1
                if left > taken:  # the replies of the pushes not taken, for the reader
                    reader.feed(data[4 * (taken - left) :])
                break
            if type(reply) is not int or reply != 1:
                self._early = reply
                break
            if not self._whole and not reader.has_data():  # all fed was parsed, to its end
                self._whole = True
            unread.popleft()
            taken += 1
        return taken

    def _arrived(self) -> bytes:
        """What has arrived on the socket, read without waiting; b"" if nothing was read
        (none arrived, the socket blocks, or it failed: :meth:`receive` meets that)."""
        sock = self._sock
        if sock is None or self._write_all is _blocking_sendall:  # none, or TLS: it would wait
            return b""
        try:
            return sock.recv(READ_SIZE)
        except OSError:  # not arrived yet (BlockingIOError), or the connection failed
            return b""

    def _reply(self) -> Any:
        reader, sock = self._reader, self._sock
        reply = reader.gets()
        while reply is False:
            if sock is None:
                raise RedisConnectionError("the line is closed")
            try:
                data = sock.recv(READ_SIZE)
            except BlockingIOError:  # not arrived yet: wait for it, up to the timeout
                data = self._waiting(sock).recv(READ_SIZE)
                sock.settimeout(0.0)
            if not data:
                raise RedisConnectionError("Connection closed by server.")
            reader.feed(data)
            self._whole = False
            reply = reader.gets()
        if not self._whole and not reader.has_data():  # all fed was parsed, to its end
            self._whole = True
        return reply

    def _sendall(self, sock: socket.socket, data: bytes) -> None:
        """``sock.sendall(data)``: one ``send`` while the socket's buffer has room."""
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):  # the buffer is full: wait for room, up to the timeout
            self._waiting(sock).sendall(memoryview(data)[sent:])
            sock.settimeout(0.0)

    def _waiting(self, sock: socket.socket) -> socket.socket:
        """``sock`` with the client's timeout again, for a call that must wait; the caller
        makes it non-blocking again once the call succeeded (else the line breaks)."""
        sock.settimeout(self._timeout)
        return sock

    def _open(self) -> socket.socket:
        self.connection.connect()
        sock = self.connection._sock
        if sock is None:  # pragma: no cover - connect() raises instead
            raise RedisConnectionError("no socket after connect")
        self._reader = Reader(replyError=ResponseError)
        self._whole = True
        self._early = _NONE
        if type(sock) is socket.socket:
            # Non-blocking between writes: a socket with a timeout polls before each send
            # and receive, a system call the line saves while the buffers have room or
            # the replies have arrived (:meth:`_sendall`, :meth:`_reply`).
            self._timeout = sock.gettimeout()
            sock.settimeout(0.0)
            self._write_all = self._sendall
        else:  # TLS: as redis-py uses it
            self._write_all = _blocking_sendall
        self._sock = sock
        return sock

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
        self._sock = None
        self._out.clear()
        self.queued = 0
        self.connection.disconnect()


def _blocking_sendall(sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)


def _redis_error(exc: BaseException, doing: str) -> BaseException:
    """``exc`` of the line's socket as redis-py names it; a Redis error stays itself."""
    if isinstance(exc, socket.timeout):
        return RedisTimeoutError(f"Timeout {doing} socket")
    if isinstance(exc, OSError):
        return RedisConnectionError(f"Error {doing} socket: {exc}")
    return exc
