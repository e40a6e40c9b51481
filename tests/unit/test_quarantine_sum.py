"""The quarantined sum of each member (``qsum``), kept by the scripts that change the quarantine,
and read in the same snapshot as pending and in flight (fakeredis)."""

from __future__ import annotations

import json

import pytest

from counters.buffer import SCORE_LIMIT, Buffer

PREFIX = "t"


@pytest.fixture
def buf(client) -> Buffer:
    return Buffer(client, PREFIX, shards=1)


def qsum(client) -> dict[str, int]:
    rows = client.zrange(f"{PREFIX}:{{s0}}:qsum", 0, -1, withscores=True)
    return {m.decode(): int(s) for m, s in rows}


def parts(buf: Buffer, member: str) -> tuple[int, int, int]:
    snap = buf.snapshot([member])
    return snap.pending[member], snap.inflight[member], snap.quarantined[member]


def quarantine(buf: Buffer, batch_id: str, deltas: dict[str, int]) -> None:
    buf.push(deltas, f"p-{batch_id}")
    batch = buf.move(0, batch_id, 100)
    assert batch is not None and buf.quarantine(batch, "Boom")


def test_a_quarantined_delta_stays_in_the_snapshot(buf, client):
    buf.push({"c:1": 7, "c:2": -2}, "p")
    batch = buf.move(0, "b1", 100)
    assert batch is not None
    assert parts(buf, "c:1") == (0, 7, 0)
    assert buf.quarantine(batch, "Boom")
    assert buf.quarantine(batch, "Boom") is False  # a repeat adds nothing
    assert (parts(buf, "c:1"), parts(buf, "c:2")) == ((0, 0, 7), (0, 0, -2))
    quarantine(buf, "b2", {"c:1": 5})  # failed again later: the sums add up
    assert qsum(client) == {"c:1": 12, "c:2": -2}
    assert parts(buf, "c:9") == (0, 0, 0)


def test_a_requeue_moves_the_delta_from_the_sum_to_pending_at_once(buf, client):
    quarantine(buf, "b1", {"c:1": 7, "c:2": -2})
    entries = buf.quarantined()
    assert buf.requeue(entries) == (2, [])
    assert (parts(buf, "c:1"), parts(buf, "c:2")) == ((7, 0, 0), (-2, 0, 0))
    assert qsum(client) == {}
    assert buf.requeue(entries) == (0, [])  # each goes back once
    assert qsum(client) == {}


def test_a_refused_requeue_keeps_the_delta_in_the_sum(buf, client):
    quarantine(buf, "b1", {"c:1": 7})
    buf.push({"c:1": SCORE_LIMIT - 1}, "huge")
    assert buf.requeue(buf.quarantined())[0] == 0
    assert qsum(client) == {"c:1": 7}


def test_a_discard_drops_the_delta_from_the_sum_once(buf, client):
    quarantine(buf, "b1", {"c:1": 7, "c:2": 1})
    quarantine(buf, "b2", {"c:1": 3})
    entries = [e for e in buf.quarantined() if e.field == "b1|c:1"]
    assert buf.discard(entries) == 1
    assert buf.discard(entries) == 0
    assert qsum(client) == {"c:1": 3, "c:2": 1}
    assert buf.discard(buf.quarantined()) == 2
    assert qsum(client) == {}


def test_an_entry_from_before_the_sum_leaves_it_alone(buf, client):
    """Entries quarantined before ``qsum`` existed are not in it: taking them out takes nothing."""
    old = {"member": "c:1", "delta": 4, "error": "Boom", "at": 1.0}
    client.hset(f"{PREFIX}:{{s0}}:quarantine", mapping={"old|c:1": json.dumps(old)})
    quarantine(buf, "b1", {"c:1": 7})
    [legacy] = [e for e in buf.quarantined() if e.field == "old|c:1"]
    assert (legacy.counted, legacy.uncount) == (False, 0)
    assert buf.discard([legacy]) == 1
    assert qsum(client) == {"c:1": 7}
    client.hset(f"{PREFIX}:{{s0}}:quarantine", mapping={"old|c:1": json.dumps(old)})
    assert buf.requeue(buf.quarantined()) == (2, [])
    assert (qsum(client), parts(buf, "c:1")) == ({}, (11, 0, 0))


def test_a_delta_set_aside_by_a_direct_write_is_in_the_sum_once(buf, client):
    buf.set_aside({"c:1": (7, "DataError: out of range"), "c:2": (-3, "DataError")}, "fb-1")
    buf.set_aside({"c:1": (7, "DataError: out of range")}, "fb-1")  # written again: same field
    assert (parts(buf, "c:1"), parts(buf, "c:2")) == ((0, 0, 7), (0, 0, -3))
    assert {e.member: (e.delta, e.counted) for e in buf.quarantined()} == {
        "c:1": (7, True),
        "c:2": (-3, True),
    }
    assert buf.requeue([e for e in buf.quarantined() if e.member == "c:1"]) == (1, [])
    assert parts(buf, "c:1") == (7, 0, 0)  # moved to pending: counted once
    assert buf.discard(buf.quarantined()) == 1
    assert qsum(client) == {}


def test_a_delta_set_aside_beyond_a_score_is_held_uncounted(buf, client):
    buf.set_aside({"c:1": (SCORE_LIMIT, "DataError")}, "fb-1")
    assert parts(buf, "c:1") == (0, 0, 0)
    assert [(e.delta, e.counted) for e in buf.quarantined()] == [(SCORE_LIMIT, False)]
    assert qsum(client) == {}
