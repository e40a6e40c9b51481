"""Buffer.narrow / quarantine / requeue / discard and the drain scripts, on fakeredis
(which does not read script flags: the scripts run without them there); the quarantined
sum of each member (``qsum``), kept by the scripts that change the quarantine, and read in
the same snapshot as pending and in flight."""

from __future__ import annotations

import json

import fakeredis
import pytest
import redis

from counters.base.exceptions import UnexpectedScriptReply
from counters.buffer import scripts
from counters.buffer.store import SCORE_LIMIT, Buffer
from counters.flushing.quarantine import error_line, narrowed_id

PREFIX = "t"


@pytest.fixture
def buf(client) -> Buffer:
    return Buffer(client, PREFIX, shards=1)


def zset(client, name: str) -> dict[str, int]:
    rows = client.zrange(f"{PREFIX}:{{s0}}:{name}", 0, -1, withscores=True)
    return {m.decode(): int(s) for m, s in rows}


def moved(buf: Buffer, deltas: dict[str, int]):
    buf.push(deltas, "p")
    return buf.move(0, "b1", 100)


def test_fakeredis_runs_the_drain_scripts_without_flags(client):
    assert scripts.flags_supported(client) is False
    script = scripts.DrainScript(client, "local k = KEYS[1] return redis.call('SET', k, ARGV[1])")
    assert script(keys=["x"], args=["1"]) == b"OK"
    assert script.resolve().script.startswith("local k")


def test_a_server_reading_flags_gets_the_flagged_script():
    class FlagReader(fakeredis.FakeRedis):
        def eval(self, script, numkeys, *args):
            if script == scripts.PROBE_SCRIPT:
                return 1
            return super().eval(script, numkeys, *args)

    client = FlagReader(server=fakeredis.FakeServer())
    assert scripts.flags_supported(client) is True
    script = scripts.DrainScript(client, "return 1")
    assert script.resolve().script == scripts.ALLOW_OOM + "return 1"


def test_a_connection_error_while_probing_is_raised_and_asked_again(client, monkeypatch):
    calls = []

    def down(*args):
        calls.append(args)
        raise redis.ConnectionError("down")

    monkeypatch.setattr(client, "eval", down)
    for _ in range(2):
        with pytest.raises(redis.ConnectionError):
            scripts.flags_supported(client)
    assert len(calls) == 2


def test_narrow_sends_the_returned_members_back_and_renames_the_batch(buf, client):
    batch = moved(buf, {"c:1": 1, "c:2": 2, "c:3": 3, "c:4": -4})
    buf.push({"c:3": 10, "c:4": 4}, "later")  # c:4 returns to a sum of 0: removed
    smaller = buf.narrow(batch, "b1/1", ["c:3", "c:4"])
    assert smaller is not None
    assert (smaller.batch_id, smaller.items, smaller.seq) == ("b1/1", {"c:1": 1, "c:2": 2}, 1)
    assert zset(client, "inflight") == {"c:1": 1, "c:2": 2}
    assert zset(client, "pending") == {"c:3": 13}
    assert client.hget(f"{PREFIX}:{{s0}}:batch", "id") == b"b1/1"
    assert client.exists(f"{PREFIX}:{{s0}}:since")
    assert buf.narrow(batch, "b1/2", ["c:2"]) is None  # b1 is no longer in flight


def test_narrow_keeps_a_member_whose_pending_sum_would_leave_the_exact_range(buf, client):
    batch = moved(buf, {"c:1": 5, "c:2": 1})
    buf.push({"c:1": SCORE_LIMIT - 3}, "huge")
    smaller = buf.narrow(batch, "b1/1", ["c:1", "c:2"])
    assert smaller is not None and smaller.items == {"c:1": 5}
    assert zset(client, "pending") == {"c:1": SCORE_LIMIT - 3, "c:2": 1}


def test_quarantine_stores_each_member_once_per_batch_and_forgets_the_batch(buf, client):
    batch = moved(buf, {"c:1": 7})
    assert buf.quarantine(batch, "Boom: " + "x" * 1000) is True
    assert buf.quarantine(batch, "Boom") is False  # no longer in flight: nothing written
    assert (buf.inflight_ids(), zset(client, "inflight")) == ({}, {})
    raw = client.hgetall(f"{PREFIX}:{{s0}}:quarantine")
    assert list(raw) == [b"b1|c:1"]
    value = json.loads(raw[b"b1|c:1"])
    assert (value["member"], value["delta"]) == ("c:1", 7)
    assert value["error"] == ("Boom: " + "x" * 1000)[:300]
    [entry] = buf.quarantined()
    assert (entry.shard, entry.field, entry.counter, entry.delta) == (0, "b1|c:1", "c", 7)


def test_requeue_puts_each_entry_back_once(buf, client):
    buf.quarantine(moved(buf, {"c:1": 7, "c:2": -2}), "Boom")
    entries = buf.quarantined()
    buf.push({"c:2": 2}, "meanwhile")
    assert buf.requeue(entries) == (2, [])
    assert zset(client, "pending") == {"c:1": 7}  # c:2 summed to 0 and was removed
    assert buf.requeue(entries) == (0, [])
    assert zset(client, "pending") == {"c:1": 7}
    assert buf.quarantined() == []


def test_requeue_refuses_a_sum_beyond_the_exact_range(buf, client):
    buf.quarantine(moved(buf, {"c:1": 7}), "Boom")
    buf.push({"c:1": SCORE_LIMIT - 1}, "huge")
    entries = buf.quarantined()
    assert buf.requeue(entries) == (0, entries)
    assert buf.quarantined() == entries


def test_discard_counts_what_was_still_there(buf):
    buf.quarantine(moved(buf, {"c:1": 7, "c:2": 1}), "Boom")
    entries = buf.quarantined()
    assert buf.discard(entries) == 2
    assert buf.discard(entries) == 0
    assert buf.discard([]) == 0


@pytest.mark.parametrize(
    ("method", "reply"),
    [("narrow", [7]), ("quarantine", 7)],
    ids=["narrow", "quarantine"],
)
def test_unknown_replies_raise(buf, monkeypatch, method, reply):
    batch = moved(buf, {"c:1": 1, "c:2": 2})
    monkeypatch.setattr(buf, f"_{method}", lambda **kwargs: reply)
    with pytest.raises(UnexpectedScriptReply) as info:
        buf.narrow(batch, "b1/1", ["c:2"]) if method == "narrow" else buf.quarantine(batch, "x")
    assert info.value.script == f"{method.upper()}_SCRIPT"


@pytest.mark.parametrize(
    ("batch_id", "expected"),
    [("abc", "abc/1"), ("abc/1", "abc/2"), ("abc/19", "abc/20"), ("abc/x", "abc/1")],
    ids=str,
)
def test_narrowed_ids(batch_id, expected):
    assert narrowed_id(batch_id) == expected


def test_error_line_names_the_type_and_the_first_line():
    assert error_line(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert error_line(KeyError()) == "KeyError"
    assert len(error_line(ValueError("x" * 1000))) == 300


def test_move_only_takes_the_given_members_that_are_pending(buf, client):
    buf.push({"c:1": 1, "c:2": 2, "c:3": 3}, "p")
    batch = buf.move(0, "b1", 10, only=["c:3", "c:1", "c:9"])
    assert batch is not None and (batch.items, batch.recovered) == ({"c:3": 3, "c:1": 1}, False)
    assert zset(client, "pending") == {"c:2": 2}
    again = buf.move(0, "b2", 10, only=["c:2"])  # b1 is still in flight: it is returned
    assert again is not None and (again.batch_id, again.recovered) == ("b1", True)
    buf.ack(0, "b1")
    assert buf.move(0, "b3", 10, only=["c:9"]) is None
    limited = buf.move(0, "b4", 1, only=["c:2", "c:1"])
    assert limited is not None and limited.items == {"c:2": 2}


# -- the quarantined sum (qsum) ------------------------------------------------------


def qsum(client) -> dict[str, int]:
    return zset(client, "qsum")


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
