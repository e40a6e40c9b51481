"""A line encodes each push's command as hiredis does (``Line._packed``), writes pushes
together, and waits on its socket only when it must."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hiredis import Reader, pack_command
from redis.exceptions import ResponseError

from counters.buffer.line import HEADS_KEPT, Line
from counters.buffer.pushids import PushId
from counters.buffer.store import PUSH_MARKER_TTL_MS, PUSH_MAX_AGE_MS, Buffer

#: The arguments of a one-member push, as the push script takes them.
ARGS = [PUSH_MARKER_TTL_MS, 1, PUSH_MAX_AGE_MS, 1, "m:1", 1]


@pytest.fixture
def buffer(client) -> Buffer:
    return Buffer(client, "linetest", shards=4)


@pytest.fixture
def line(buffer) -> Line:
    return Line(buffer)


def expected(line: Line, keys: list, args: list) -> bytes:
    return pack_command(("EVALSHA", line.sha, len(keys), *keys, *args))


@pytest.mark.parametrize(
    "deltas",
    [
        {"unread:7": 1},
        {"unread:7": -1},
        {"unread:123456789012": 2**53 - 1},
        {"unread:-5": -(2**40)},
        {"naïve:clé é": 3},  # a member of several bytes per character
        {"unread:": 1},
        {"a:1": 1, "b:2": -2, "c:3": 5, "d:4": 1},  # several members, several shards
    ],
)
def test_every_push_is_encoded_as_hiredis_encodes_it(buffer, line, deltas):
    for seq in (1, 2, 10**12):
        plan = buffer.plan_push(deltas, PushId("w-" + "a" * 16, seq))
        assert plan.calls
        for keys, args in plan.calls:
            assert line._packed(keys, args) == expected(line, keys, args)
        # a plan of one member of ASCII carries its command encoded already
        one = len(plan.calls) == 1 and len(plan.calls[0][1]) == 6
        assert (plan.wire is not None) == (one and all(m.isascii() for m in deltas))
        if plan.wire is not None:
            assert plan.wire == expected(line, *plan.calls[0])


def test_a_push_made_with_other_limits_is_encoded_by_hiredis(buffer, line, monkeypatch):
    from counters.buffer import intake

    monkeypatch.setattr(intake, "PUSH_MAX_AGE_MS", 5000)
    plan = buffer.plan_push({"unread:7": 1}, PushId("w-" + "a" * 16, 3))
    assert plan.wire is None and plan.calls[0][1][2] == 5000
    assert line._packed(*plan.calls[0]) == expected(line, *plan.calls[0])


def test_arguments_of_other_types_go_to_hiredis(line):
    keys = ["k:{0}:pending", "k:{0}:writer", "k:{0}:since"]
    for args in (
        [PUSH_MARKER_TTL_MS, 1, PUSH_MAX_AGE_MS, 1, b"bytes:member", 1],
        [PUSH_MARKER_TTL_MS, 1, PUSH_MAX_AGE_MS, 1, "m:1", 2.0],
        [PUSH_MARKER_TTL_MS, 1.5, PUSH_MAX_AGE_MS, 1, "m:1", 1],
        [PUSH_MARKER_TTL_MS, 1, PUSH_MAX_AGE_MS, 1, "m:1", 1, "m:2", 2],
        [60000, 1, PUSH_MAX_AGE_MS, 1, "m:1", 1],  # not the script's own limits
        [PUSH_MARKER_TTL_MS, 1, 600000, 1, "m:1", 1],
    ):
        assert line._packed(tuple(keys), args) == expected(line, keys, args)
    assert not line._heads  # none of them used a head


def test_a_push_of_other_characters_than_ascii_goes_to_hiredis(line):
    args = ARGS
    keys = ("préfixe:{0}:pending", "préfixe:{0}:w:a", "préfixe:{0}:since")
    assert line._packed(keys, args) == expected(line, keys, args)
    assert line._heads[keys] == ""  # kept as such: hiredis encodes it each time
    assert line._packed(keys, args) == expected(line, keys, args)
    ascii_keys = ("k:{0}:pending", "k:{0}:w:a", "k:{0}:since")
    other = [PUSH_MARKER_TTL_MS, 1, PUSH_MAX_AGE_MS, 1, "m:é", 1]
    assert line._packed(ascii_keys, other) == expected(line, ascii_keys, other)


def test_heads_are_kept_per_keys_and_bounded(line):
    args = ARGS
    for i in range(HEADS_KEPT + 5):
        keys = (f"k:{i}:pending", f"k:{i}:writer", f"k:{i}:since")
        assert line._packed(keys, args) == expected(line, keys, args)
        assert keys in line._heads
        assert line._packed(keys, args) == expected(line, keys, args)  # from the kept head
        assert line._packed(list(keys), args) == expected(line, keys, args)  # by hiredis
    assert 0 < len(line._heads) <= HEADS_KEPT


def test_pushes_taken_are_written_together_and_a_read_writes_what_it_needs(
    redis_client, counters_prefix
):
    buffer = Buffer(redis_client, counters_prefix, shards=4)
    line = Line(buffer)
    plans = [buffer.plan_push({f"m:{i}": 1}, PushId("w-" + "b" * 16, i + 1)) for i in range(3)]
    try:
        for plan in plans:
            line.send(plan, now=False)
        assert (line.queued, len(line.unread)) == (3, 3)
        assert buffer.snapshot(["m:0"]).pending["m:0"] == 0  # nothing written yet
        line.write()
        assert line.queued == 0
        line.send(buffer.plan_push({"m:0": 2}, PushId("w-" + "b" * 16, 4)), now=False)
        replies = [line.receive()[1] for _ in range(4)]  # the last one written by its read
        assert replies == [[1]] * 4 and line.queued == 0 and not line.unread
        assert buffer.snapshot(["m:0", "m:1", "m:2"]).pending == {"m:0": 3, "m:1": 1, "m:2": 1}
        line.send(buffer.plan_push({"m:1": 1}, PushId("w-" + "b" * 16, 5)), now=False)
        line.close()  # a push taken and not written never leaves
        assert line.abandon() and line.queued == 0
        assert buffer.snapshot(["m:1"]).pending["m:1"] == 1
    finally:
        line.close()


def test_the_line_socket_is_non_blocking_between_writes(redis_client, counters_prefix):
    buffer = Buffer(redis_client, counters_prefix, shards=4)
    line = Line(buffer)
    try:
        line.send(buffer.plan_push({"m:1": 1}, PushId("w-" + "c" * 16, 1)))
        assert line._sock is not None and line._sock.gettimeout() == 0.0
        assert line._timeout == redis_client.connection_pool.connection_kwargs["socket_timeout"]
        assert line.receive()[1] == [1]  # waited for: Redis answers after the write
        assert line._sock.gettimeout() == 0.0
    finally:
        line.close()


@pytest.fixture
def pair(line):
    """A non-blocking socket of the line's own (as a line makes it) and its peer."""
    ours, peer = socket.socketpair()
    ours.settimeout(0.0)
    line._sock, line._timeout, line._reader = ours, 0.5, Reader(replyError=ResponseError)
    yield ours, peer
    line._sock = None
    ours.close()
    peer.close()


def later(seconds: float, action) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_full_socket_buffer_waits_for_room_up_to_the_timeout(line, pair):
    ours, peer = pair
    data = bytes(range(256)) * 32768  # 8 MiB: more than the socket buffers hold
    received = bytearray()

    def drain() -> None:
        while len(received) < len(data):
            received.extend(peer.recv(1 << 20))

    reader = later(0.1, drain)
    line._sendall(ours, data)
    reader.join()
    assert received == data and ours.gettimeout() == 0.0
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        line._sendall(ours, data)  # nobody reads: the client's timeout
    assert time.monotonic() - started >= 0.4


def test_a_reply_not_arrived_yet_is_waited_for_up_to_the_timeout(line, pair):
    ours, peer = pair
    writer = later(0.1, lambda: peer.sendall(b":1\r\n"))
    assert line._reply() == 1
    writer.join()
    assert ours.gettimeout() == 0.0
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        line._reply()  # nothing comes
    assert time.monotonic() - started >= 0.4
