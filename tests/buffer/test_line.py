"""A line encodes each push's command as hiredis does (``Line._packed``), writes pushes
together, and waits for a reply only when it must."""

from __future__ import annotations

import time

import pytest
import redis
from hiredis import Reader, pack_command
from redis.exceptions import NoScriptError

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


@pytest.mark.parametrize(
    ("member", "delta"),
    [
        ("unread:7", 1),
        ("unread:7", -1),
        ("unread:7", 12),
        ("unread:123456789012", 2**53 - 1),
        ("unread:-5", -(2**40)),
        ("unread:", 1),
        ("k:" + "x" * 300, 1),  # a member longer than the lengths looked up
    ],
)
def test_the_command_of_a_push_of_one_member_is_encoded_as_hiredis_encodes_it(
    buffer, line, member, delta
):
    writer = "w-" + "a" * 16
    for seq in (1, 2, 10**12):
        before = int(time.time() * 1000)
        plan = buffer.plan_push({member: delta}, PushId(writer, seq))
        after = int(time.time() * 1000)
        wire = plan.wire
        assert wire is not None
        reader = Reader()
        reader.feed(wire)
        parsed = reader.gets()
        sent_at = int(parsed[8])
        assert before <= sent_at <= after
        ((keys, args),) = plan.calls
        assert args[1] == sent_at
        assert wire == expected(line, keys, args)


@pytest.mark.parametrize(
    ("member", "delta"),
    [("naïve:clé", 1), ("unread:7", 0), ("unread:7", 2**53), ("unread:7", 2.0), ("unread:7", True)],
)
def test_a_push_of_one_member_of_another_kind_is_left_to_its_plan(buffer, member, delta):
    assert buffer.plan_push({member: delta}, PushId("w-" + "a" * 16, 1)).wire is None


def test_a_push_of_one_member_with_other_limits_is_left_to_its_plan(buffer, monkeypatch):
    from counters.buffer import intake

    writer = "w-" + "a" * 16
    assert buffer.plan_push({"unread:7": 1}, PushId(writer, 1)).wire is not None
    monkeypatch.setattr(intake, "PUSH_MARKER_TTL_MS", 5000)
    assert buffer.plan_push({"unread:7": 1}, PushId(writer, 1)).wire is None


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


def test_pushes_taken_are_written_together_and_a_read_writes_what_it_needs(real_buffer):
    buffer = real_buffer
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


def test_a_reply_not_arrived_yet_is_waited_for_up_to_the_timeout(own_redis, counters_prefix):
    client = redis.Redis.from_url(own_redis.url, socket_timeout=0.5)
    buffer = Buffer(client, counters_prefix, shards=4)
    client.script_load(buffer._push.script)
    pauser = own_redis.client()
    line = Line(buffer)
    try:
        line.send(buffer.plan_push({"p:1": 1}, PushId("w-" + "c" * 16, 1)))
        assert line.receive()[1] == [1]  # the line is open
        pauser.execute_command("CLIENT", "PAUSE", 200, "ALL")
        started = time.monotonic()
        line.send(buffer.plan_push({"p:1": 1}, PushId("w-" + "c" * 16, 2)))
        assert line.receive()[1] == [1]  # answered once the pause ends: waited for
        assert time.monotonic() - started >= 0.15
        pauser.execute_command("CLIENT", "PAUSE", 2000, "ALL")
        plan = buffer.plan_push({"p:1": 1}, PushId("w-" + "c" * 16, 3))
        line.send(plan)
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            line.receive()  # nothing comes within the client's timeout
        assert time.monotonic() - started >= 0.4
        assert line.broken and line.abandon() == []  # the push was taken by receive()
        pauser.execute_command("CLIENT", "UNPAUSE")
    finally:
        line.close()
        pauser.close()
        client.close()


def written(line: Line, buffer: Buffer, pushes: list[tuple[dict[str, int], int]]) -> None:
    """Write ``pushes`` ((deltas, seq) of one writer) on ``line``, then wait until the
    replies have all arrived on its socket (each reply of these is 4 bytes or more)."""
    calls = 0
    for deltas, seq in pushes:
        plan = buffer.plan_push(deltas, PushId("w-" + "d" * 16, seq))
        calls += len(plan.calls)
        line.send(plan, now=False)
    line.write()
    arrived(line)


def arrived(line: Line) -> None:
    """Wait until replies have arrived on the line's connection, then a little more: Redis
    answers the pushes of one write together."""
    deadline = time.monotonic() + 5
    while not line.connection.can_read(timeout=0.05):
        assert time.monotonic() < deadline, "the replies never arrived"
    time.sleep(0.02)


@pytest.fixture
def real_buffer(redis_client, counters_prefix) -> Buffer:
    """A buffer on the test Redis whose push script is loaded there (a server started for
    the run knows none until some push loads it)."""
    buffer = Buffer(redis_client, counters_prefix, shards=4)
    redis_client.script_load(buffer._push.script)
    return buffer


def test_replies_of_added_pushes_are_taken_together_and_the_rest_left_for_receive(real_buffer):
    buffer = real_buffer
    line = Line(buffer)
    try:
        written(line, buffer, [({f"m:{i}": 1}, i) for i in range(1, 6)])
        assert line.receive_added(3) == 3  # three taken, two left
        assert len(line.unread) == 2
        assert line.receive()[1] == [1]  # one of those kept
        assert line.receive_added(10) == 1 and not line.unread
        assert line.receive_added(10) == 0  # nothing unread: nothing read
        # a repeat (refused: 0) stops the run; receive() returns its reply
        written(line, buffer, [({"m:5": 1}, 5), ({"m:2": 1}, 6), ({"m:3": 1}, 7)])
        assert line.receive_added(3) == 0
        assert line.receive()[1] == [0]
        assert line.receive_added(3) == 2 and not line.unread
        pending = buffer.snapshot(["m:5", "m:2", "m:3"]).pending
        assert pending == {"m:5": 1, "m:2": 2, "m:3": 2}
    finally:
        line.close()


def test_a_push_of_several_shards_among_them_is_read_by_receive(real_buffer):
    buffer = real_buffer
    line = Line(buffer)
    several = {f"m:{i}": 1 for i in range(8)}
    assert len(buffer.plan_push(several, PushId("w-" + "d" * 16, 2)).calls) > 1
    try:
        written(line, buffer, [({"a:1": 1}, 1), (several, 2), ({"a:2": 1}, 3)])
        assert line.receive_added(3) == 1  # the push of several shards stops it
        plan, replies = line.receive()
        assert plan.deltas == several and replies == [1] * len(plan.calls)
        assert line.receive_added(3) == 1 and not line.unread
        assert buffer.snapshot(["a:1", "a:2", "m:0"]).pending == {"a:1": 1, "a:2": 1, "m:0": 1}
    finally:
        line.close()


def test_an_error_reply_stops_the_run_and_receive_raises_it(own_redis, counters_prefix):
    client = redis.Redis.from_url(own_redis.url, socket_timeout=5)
    buffer = Buffer(client, counters_prefix, shards=4)
    client.script_load(buffer._push.script)
    line = Line(buffer)
    try:
        written(line, buffer, [({"b:1": 1}, 1)])
        assert line.receive_added(1) == 1
        client.script_flush()  # the next pushes find no script
        written(line, buffer, [({"b:2": 1}, 2), ({"b:3": 1}, 3)])
        assert line.receive_added(2) == 0
        with pytest.raises(NoScriptError):
            line.receive()
        assert line.receive_added(1) == 0  # the next reply is an error too
        with pytest.raises(NoScriptError):
            line.receive()
        assert not line.unread and not line.broken
        assert buffer.snapshot(["b:1", "b:2", "b:3"]).pending == {"b:1": 1, "b:2": 0, "b:3": 0}
    finally:
        line.close()
        client.close()


def test_a_reply_not_arrived_is_not_waited_for(own_redis, counters_prefix):
    client = redis.Redis.from_url(own_redis.url, socket_timeout=5)
    buffer = Buffer(client, counters_prefix, shards=4)
    client.script_load(buffer._push.script)
    pauser = own_redis.client()
    line = Line(buffer)
    try:
        written(line, buffer, [({"n:1": 1}, 1)])  # the line is open
        assert line.receive_added(1) == 1
        pauser.execute_command("CLIENT", "PAUSE", 300, "ALL")
        for seq in (2, 3):
            line.send(buffer.plan_push({"n:1": 1}, PushId("w-" + "f" * 16, seq)))
        started = time.monotonic()
        assert line.receive_added(2) == 0  # nothing arrived: nothing read, nothing waited for
        assert time.monotonic() - started < 0.1 and len(line.unread) == 2
        arrived(line)  # once the pause ends
        assert line.receive_added(2) == 2 and not line.unread
        assert buffer.snapshot(["n:1"]).pending["n:1"] == 3
    finally:
        line.close()
        pauser.close()
        client.close()
