"""The marks of suspect members: each push that changes a marked member counts itself."""

from __future__ import annotations

import pytest

from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.verify.drift import SUSPECTS_TTL_MS, Marks

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("redis_backend")]


@pytest.fixture
def buf(redis_client, counters_prefix) -> Buffer:
    return Buffer(redis_client, f"{counters_prefix}:marks", shards=1)


def test_a_push_counts_itself_in_the_marks_of_the_members_it_changes(buf):
    suspects = buf.key(0, "suspects")
    buf.push({"unread:1": 1, "unread:2": 1}, "w1:1")
    assert not buf.client.exists(suspects)  # nothing marked: nothing written
    buf.client.hset(suspects, "unread:1", 0)
    buf.push({"unread:1": 1, "unread:2": 5}, "w1:2")
    buf.push({"unread:1": -1}, "w1:3")
    buf.push({"unread:2": -1}, "w1:4")
    assert buf.push({"unread:1": 1}, "w1:3") == set()  # a repeat: refused, not counted
    assert buf.client.hgetall(suspects) == {b"unread:1": b"2"}  # the other member is unmarked
    assert buf.snapshot(["unread:1", "unread:2"]).pending == {"unread:1": 1, "unread:2": 5}


def test_marks_start_at_a_random_count_and_are_removed_after(counters_prefix):
    buffer = get_buffer()
    members = ["unread:1", "unread:2"]
    marks = Marks("default")
    marks.mark(members)
    first = marks.counts(members)
    assert all(isinstance(c, int) for c in first.values())
    marks.mark(members)  # marked already: kept as they are
    assert marks.counts(members) == first
    buffer.push({"unread:1": 1}, "w1:1")
    assert marks.counts(members) == {
        "unread:1": first["unread:1"] + 1,
        "unread:2": first["unread:2"],
    }
    key = buffer.key(buffer.shard_of("unread:1"), "suspects")
    assert 0 < buffer.client.pttl(key) <= SUSPECTS_TTL_MS
    marks.remove()
    assert marks.counts(members) == {"unread:1": None, "unread:2": None}
    assert not any(buffer.client.exists(buffer.key(s, "suspects")) for s in range(buffer.shards))
