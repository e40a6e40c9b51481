"""A line encodes each push's command as hiredis does (``Line._packed``)."""

from __future__ import annotations

import pytest
from hiredis import pack_command

from counters.buffer.line import HEADS_KEPT, Line
from counters.buffer.pushids import PushId
from counters.buffer.store import Buffer


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


def test_arguments_of_other_types_go_to_hiredis(line):
    keys = ["k:{0}:pending", "k:{0}:writer", "k:{0}:since"]
    for args in (
        [60000, 1, 600000, 1, b"bytes:member", 1],
        [60000, 1, 600000, 1, "m:1", 2.0],
        [60000, 1.5, 600000, 1, "m:1", 1],
        [60000, 1, 600000, 1, "m:1", 1, "m:2", 2],
    ):
        assert line._packed(keys, args) == expected(line, keys, args)


def test_a_push_of_other_characters_than_ascii_goes_to_hiredis(line):
    args = [60000, 1, 600000, 1, "m:1", 1]
    keys = ("préfixe:{0}:pending", "préfixe:{0}:w:a", "préfixe:{0}:since")
    assert line._packed(keys, args) == expected(line, keys, args)
    assert line._heads[keys] == ""  # kept as such: hiredis encodes it each time
    assert line._packed(keys, args) == expected(line, keys, args)
    ascii_keys = ("k:{0}:pending", "k:{0}:w:a", "k:{0}:since")
    assert line._packed(ascii_keys, [60000, 1, 600000, 1, "m:é", 1]) == expected(
        line, ascii_keys, [60000, 1, 600000, 1, "m:é", 1]
    )


def test_heads_are_kept_per_keys_and_bounded(line):
    args = [60000, 1, 600000, 1, "m:1", 1]
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
