"""counters.buffer.store.Buffer on fakeredis: push, move, ack, snapshot, layout."""

from __future__ import annotations

import re
import time

import pytest
from redis.exceptions import ResponseError

from counters.base.exceptions import RedisTooOld
from counters.buffer.store import PUSH_MARKER_TTL_MS, Buffer, shard_of

PREFIX = "t"
# With 4 shards: c:1, c:3 and c:8 live in shard 0, c:5 in shard 1, c:2 in shard 2, c:4 in shard 3.
KEY_RE = re.compile(r"^t:\{s(\d+)\}:(pending|inflight|batch|gen|since|seq|epoch|lease|w:.+)$")


@pytest.fixture
def buf(client) -> Buffer:
    return Buffer(client, PREFIX, shards=4)


def pending(client, shard: int) -> dict[str, int]:
    rows = client.zrange(f"{PREFIX}:{{s{shard}}}:pending", 0, -1, withscores=True)
    return {m.decode(): int(s) for m, s in rows}


def inflight(client, shard: int) -> dict[str, int]:
    rows = client.zrange(f"{PREFIX}:{{s{shard}}}:inflight", 0, -1, withscores=True)
    return {m.decode(): int(s) for m, s in rows}


# -- sharding and layout ----------------------------------------------------------


@pytest.mark.parametrize(
    ("member", "shards", "expected"),
    [
        ("c:1", 4, 0),
        ("c:2", 4, 2),
        ("c:4", 4, 3),
        ("c:5", 4, 1),
        ("unread:1", 16, 11),
        ("unread:42", 16, 14),
        ("unread:42", 1, 0),
    ],
    ids=lambda v: str(v),
)
def test_shard_of_is_stable_across_processes(member, shards, expected):
    # Pinned values: a change of hash (e.g. to the randomized hash()) would strand
    # pending deltas of running deployments in the wrong shards.
    assert shard_of(member, shards) == expected


def test_buffer_rejects_zero_shards(client):
    with pytest.raises(ValueError, match="shards must be at least 1"):
        Buffer(client, PREFIX, shards=0)


def test_key_layout(buf):
    assert buf.key(3, "pending") == "t:{s3}:pending"
    assert buf.by_shard(["c:1", "c:2", "c:3", "c:5"]) == {0: ["c:1", "c:3"], 2: ["c:2"], 1: ["c:5"]}


def test_every_key_of_a_shard_shares_its_hash_tag(buf, client):
    buf.push({"c:1": 1, "c:2": 2, "c:4": 4, "c:5": 5}, "p1")
    for shard in range(4):
        batch = buf.move(shard, f"b{shard}", 10)
        assert batch is not None
        assert buf.ack(shard, batch.batch_id) is True
    buf.push({"c:1": 1, "c:2": 1}, "p2")
    buf.move(0, "b-open", 10)
    keys = sorted(k.decode() for k in client.keys("*"))
    assert keys == [
        "t:{s0}:batch",
        "t:{s0}:gen",
        "t:{s0}:inflight",
        "t:{s0}:seq",
        "t:{s0}:w:p1",
        "t:{s0}:w:p2",
        "t:{s1}:gen",
        "t:{s1}:seq",
        "t:{s1}:w:p1",
        "t:{s2}:gen",
        "t:{s2}:pending",
        "t:{s2}:seq",
        "t:{s2}:since",
        "t:{s2}:w:p1",
        "t:{s2}:w:p2",
        "t:{s3}:gen",
        "t:{s3}:seq",
        "t:{s3}:w:p1",
    ]
    assert all(KEY_RE.match(k) for k in keys)


def test_since_marks_when_a_shard_became_non_empty_and_clears_when_drained(buf, client):
    buf.push({"c:1": 1}, "p1")
    since = int(client.get("t:{s0}:since"))
    buf.push({"c:1": 1}, "p2")
    assert int(client.get("t:{s0}:since")) == since  # kept: the oldest delta is older
    batch = buf.move(0, "b1", 10)
    assert client.get("t:{s0}:since") is None
    buf.ack(0, batch.batch_id)


def test_since_clears_when_deltas_cancel_out_and_marks_the_next_push(buf, client):
    buf.push({"c:1": 1}, "p1")
    assert client.get("t:{s0}:since") is not None
    buf.push({"c:1": -1}, "p2")  # the set is empty again: no lag is left behind
    assert client.get("t:{s0}:since") is None
    buf.push({"c:3": 1}, "p3")
    assert int(client.get("t:{s0}:since")) > 0


# -- push ---------------------------------------------------------------------------


def test_push_aggregates_deltas_per_member(buf, client):
    assert buf.push({"c:1": 2, "c:3": -1}, "p1") == {0}
    assert buf.push({"c:1": 3, "c:3": -4}, "p2") == {0}
    assert pending(client, 0) == {"c:3": -5, "c:1": 5}
    assert buf.pending_count(0) == 2


def test_push_puts_members_in_their_shard_only(buf, client):
    assert buf.push({"c:1": 1, "c:2": 2, "c:4": 4, "c:5": 5}, "p1") == {0, 1, 2, 3}
    assert [pending(client, s) for s in range(4)] == [
        {"c:1": 1},
        {"c:5": 5},
        {"c:2": 2},
        {"c:4": 4},
    ]


def test_push_removes_members_whose_sum_reaches_zero(buf, client):
    buf.push({"c:1": 1, "c:3": 2}, "p1")
    buf.push({"c:1": -1, "c:3": -1}, "p2")
    assert pending(client, 0) == {"c:3": 1}
    buf.push({"c:3": -1}, "p3")
    assert client.exists("t:{s0}:pending") == 0
    assert buf.pending_count(0) == 0


def test_push_skips_zero_deltas_and_empty_pushes(buf, client):
    assert buf.push({"c:1": 0, "c:2": 0}, "p1") == set()
    assert buf.push({}, "p2") == set()
    assert client.keys("*") == []
    assert buf.push({"c:1": 0, "c:2": 7}, "p3") == {2}
    assert pending(client, 0) == {}
    assert pending(client, 2) == {"c:2": 7}


def test_push_with_the_same_id_adds_once(buf, client):
    assert buf.push({"c:1": 2, "c:2": 3}, "same") == {0, 2}
    assert buf.push({"c:1": 2, "c:2": 3}, "same") == set()
    assert pending(client, 0) == {"c:1": 2}
    assert pending(client, 2) == {"c:2": 3}


def test_push_with_different_ids_adds_twice(buf, client):
    buf.push({"c:1": 2, "c:2": 3}, "first")
    buf.push({"c:1": 2, "c:2": 3}, "second")
    assert pending(client, 0) == {"c:1": 4}
    assert pending(client, 2) == {"c:2": 6}


def test_writer_mark_is_per_shard_and_expires(buf, client):
    buf.push({"c:1": 1}, "p1")
    # The same id on another shard is a different mark: shard 2 was not pushed yet.
    buf.push({"c:1": 1, "c:2": 1}, "p1")
    assert pending(client, 0) == {"c:1": 1}
    assert pending(client, 2) == {"c:2": 1}
    assert client.hgetall("t:{s0}:w:p1") == {b"seq": b"1"}
    ttl = client.pttl("t:{s0}:w:p1")
    assert 0 < ttl <= PUSH_MARKER_TTL_MS


# -- move and ack -------------------------------------------------------------------


def test_move_returns_none_when_nothing_is_pending(buf, client):
    assert buf.move(0, "b1", 10) is None
    assert client.keys("*") == []
    assert buf.generations([0]) == {0: 0}


def test_move_takes_at_most_limit_members_lowest_scores_first(buf, client):
    buf.push({"c:1": 5, "c:3": -2, "c:8": 1}, "p1")
    batch = buf.move(0, "b1", 2)
    assert batch is not None
    assert (batch.shard, batch.batch_id, batch.recovered) == (0, "b1", False)
    assert batch.items == {"c:3": -2, "c:8": 1}
    assert inflight(client, 0) == {"c:3": -2, "c:8": 1}
    assert pending(client, 0) == {"c:1": 5}
    assert client.hget("t:{s0}:batch", "id") == b"b1"
    assert int(client.hget("t:{s0}:batch", "ts")) == batch.moved_at_ms
    assert abs(batch.moved_at_ms - time.time() * 1000) < 5_000


def test_move_of_more_than_one_lua_chunk(client):
    buf = Buffer(client, PREFIX, shards=1)
    deltas = {f"c:{i}": i + 1 for i in range(2500)}
    buf.push(deltas, "p1")
    batch = buf.move(0, "big", 3000)
    assert batch is not None
    assert batch.items == deltas
    assert client.zcard("t:{s0}:inflight") == 2500
    assert buf.pending_count(0) == 0


def test_second_move_returns_the_batch_in_flight(buf, client):
    buf.push({"c:1": 5, "c:3": -2}, "p1")
    first = buf.move(0, "b1", 10)
    buf.push({"c:1": 1, "c:8": 9}, "p2")
    again = buf.move(0, "b2", 10)
    assert first is not None and again is not None
    assert again.recovered is True
    assert (again.batch_id, again.moved_at_ms, again.items) == (
        "b1",
        first.moved_at_ms,
        {"c:3": -2, "c:1": 5},
    )
    # Nothing new was moved while b1 is in flight.
    assert pending(client, 0) == {"c:1": 1, "c:8": 9}


def test_ack_with_a_wrong_id_keeps_the_batch(buf, client):
    buf.push({"c:1": 5}, "p1")
    buf.move(0, "b1", 10)
    assert buf.ack(0, "other") is False
    assert inflight(client, 0) == {"c:1": 5}
    assert buf.inflight_ids() == {0: "b1"}
    again = buf.move(0, "b2", 10)
    assert again is not None
    assert (again.batch_id, again.recovered, again.items) == ("b1", True, {"c:1": 5})


def test_ack_with_the_right_id_clears_it_and_the_next_move_starts_a_new_batch(buf, client):
    buf.push({"c:1": 5}, "p1")
    buf.move(0, "b1", 10)
    buf.push({"c:3": 2}, "p2")
    assert buf.ack(0, "b1") is True
    assert client.exists("t:{s0}:inflight", "t:{s0}:batch") == 0
    assert buf.inflight_ids() == {}
    assert buf.ack(0, "b1") is False
    batch = buf.move(0, "b2", 10)
    assert batch is not None
    assert (batch.batch_id, batch.recovered, batch.items) == ("b2", False, {"c:3": 2})
    assert buf.move(0, "b3", 10).batch_id == "b2"


def test_each_moved_batch_takes_the_next_sequence_number_of_its_shard(buf, client):
    buf.push({"c:1": 5, "c:4": 1}, "p1")
    first = buf.move(0, "b1", 10)
    assert first is not None
    assert (first.seq, first.prefix) == (1, PREFIX)
    again = buf.move(0, "b2", 10)
    assert again is not None
    assert (again.batch_id, again.seq) == ("b1", 1)  # recovered: the same number
    buf.ack(0, "b1")
    assert buf.move(0, "b3", 10) is None  # nothing pending: no number taken
    buf.push({"c:3": 1}, "p2")
    second = buf.move(0, "b4", 10)
    assert second is not None and second.seq == 2
    assert buf.move(3, "b5", 10).seq == 1  # each shard numbers its own batches
    assert (int(client.get("t:{s0}:seq")), int(client.get("t:{s3}:seq"))) == (2, 1)


def test_ack_of_a_shard_without_batch_is_false(buf):
    assert buf.ack(1, "b1") is False
    assert buf.generations([1]) == {1: 0}


def test_generation_bumps_on_move_and_ack_only(buf):
    buf.push({"c:1": 5, "c:2": 1}, "p1")
    assert buf.generations([0, 2]) == {0: 0, 2: 0}
    buf.move(0, "b1", 10)
    assert buf.generations([0, 2]) == {0: 1, 2: 0}
    buf.move(0, "b2", 10)  # recovered: no change
    buf.ack(0, "wrong")
    assert buf.generations([0, 2]) == {0: 1, 2: 0}
    buf.ack(0, "b1")
    assert buf.generations([0, 2]) == {0: 2, 2: 0}
    assert buf.move(0, "b3", 10) is None
    assert buf.generations([0, 2]) == {0: 2, 2: 0}


def test_inflight_ids_lists_only_shards_with_a_batch(buf):
    buf.push({"c:1": 1, "c:2": 2, "c:4": 4}, "p1")
    buf.move(0, "b0", 10)
    buf.move(3, "b3", 10)
    assert buf.inflight_ids() == {0: "b0", 3: "b3"}
    buf.ack(0, "b0")
    assert buf.inflight_ids() == {3: "b3"}


# -- snapshot -----------------------------------------------------------------------


def test_snapshot_reports_pending_and_inflight_per_member(buf):
    buf.push({"c:1": 5, "c:2": 7, "c:4": -3}, "p1")
    buf.move(0, "b0", 10)
    buf.push({"c:1": 2, "c:3": 1}, "p2")
    snap = buf.snapshot(["c:1", "c:2", "c:3", "c:5"])
    assert snap.pending == {"c:1": 2, "c:2": 7, "c:3": 1, "c:5": 0}
    assert snap.inflight == {"c:1": 5, "c:2": 0, "c:3": 0, "c:5": 0}
    assert snap.inflight_ids == {0: "b0"}
    assert snap.gens == {0: 1, 1: 0, 2: 0}


def test_snapshot_after_ack_and_of_no_members(buf):
    buf.push({"c:1": 5}, "p1")
    buf.move(0, "b0", 10)
    buf.ack(0, "b0")
    snap = buf.snapshot(["c:1"])
    assert (snap.pending, snap.inflight, snap.inflight_ids, snap.gens) == (
        {"c:1": 0},
        {"c:1": 0},
        {},
        {0: 2},
    )
    empty = buf.snapshot([])
    assert (empty.pending, empty.inflight, empty.inflight_ids, empty.gens) == ({}, {}, {}, {})


def test_prefixes_do_not_see_each_other(client):
    a, b = Buffer(client, "a", shards=1), Buffer(client, "b", shards=1)
    a.push({"c:1": 3}, "p1")
    b.push({"c:1": 4}, "p1")
    assert a.snapshot(["c:1"]).pending == {"c:1": 3}
    assert b.snapshot(["c:1"]).pending == {"c:1": 4}


@pytest.mark.parametrize(
    "deltas", [{"c:1": 1}, {"c:1": 1, "c:2": 2}], ids=["one-shard", "two-shards"]
)
def test_push_and_snapshot_survive_a_flushed_script_cache(buf, client, deltas):
    """After SCRIPT FLUSH (or a Redis restart) the scripts are loaded again."""
    client.script_flush()
    assert buf.push(deltas, "p1") == {buf.shard_of(m) for m in deltas}
    client.script_flush()
    assert buf.snapshot(list(deltas)).pending == deltas


def test_push_delivered_too_late_is_refused(buf, client, monkeypatch):
    from types import SimpleNamespace

    from counters.base.exceptions import StalePush
    from counters.buffer import intake

    real_ns = intake.time.time_ns  # the writer's clock an hour behind Redis's
    monkeypatch.setattr(intake, "time", SimpleNamespace(time_ns=lambda: real_ns() - 3600 * 10**9))
    with pytest.raises(StalePush):
        buf.push({"c:1": 1}, "late")
    assert pending(client, 0) == {}


def test_fence_reports_whether_the_push_had_landed(buf, client):
    buf.push({"c:1": 1}, "landed")
    assert buf.fence(["c:1", "c:2"], "landed") == {0}
    assert buf.fence(["c:1"], "never-sent") == set()
    assert buf.push({"c:1": 5}, "never-sent") == set()  # fenced: it can no longer apply
    assert pending(client, 0) == {"c:1": 1}
    assert buf.fence(["c:1"], "never-sent") == set()  # fencing twice is harmless


def test_a_move_acknowledges_the_batch_it_names_then_moves_the_next(buf, client):
    buf.push({"c:1": 5}, "p1")
    buf.move(0, "b1", 10)
    buf.push({"c:3": 2}, "p2")
    wrong = buf.move(0, "b2", 10, ack="other")  # not the batch in flight: nothing is dropped
    assert wrong is not None
    assert (wrong.batch_id, wrong.recovered, wrong.items) == ("b1", True, {"c:1": 5})
    batch = buf.move(0, "b2", 10, ack="b1")
    assert batch is not None
    assert (batch.batch_id, batch.recovered, batch.items) == ("b2", False, {"c:3": 2})
    assert buf.move(0, "b3", 10, ack="b2") is None  # acknowledged, and nothing pending
    assert buf.inflight_ids() == {}
    assert client.exists("t:{s0}:inflight", "t:{s0}:batch") == 0


def test_a_move_takes_the_lowest_scores_first_and_drops_zero_sums(client):
    buf = Buffer(client, PREFIX, shards=1)
    buf.push({"c:1": 3, "c:2": -2, "c:3": 1, "c:4": 7}, "p1")
    client.zadd("t:{s0}:pending", {"c:5": 0})  # a zero sum left behind: never applied
    batch = buf.move(0, "b1", 3)
    assert batch is not None
    assert batch.items == {"c:2": -2, "c:3": 1}  # c:5 (0) was among the 3 lowest, dropped
    assert all(type(v) is int for v in batch.items.values())
    assert client.zrange("t:{s0}:pending", 0, -1) == [b"c:1", b"c:4"]


@pytest.mark.parametrize(
    "refusal",
    [
        # Redis 6.0 and 6.2's own wording for a command it does not know, inside a script.
        "Error running script (call to f_0a1b): @user_script:14: @user_script: 14: "
        "Unknown Redis command called from Lua script",
        "ERR unknown command 'zrangestore', with args beginning with: ",
    ],
)
def test_move_on_a_redis_older_than_6_2_says_which_version_it_needs(buf, client, refusal):
    buf.push({"unread:1": 1}, "p1")

    def too_old(keys=(), args=()):
        raise ResponseError(refusal)

    buf._move = too_old
    with pytest.raises(RedisTooOld, match=r"does not know ZRANGESTORE: Tally needs Redis 6\.2"):
        buf.move(shard_of("unread:1", buf.shards), "b1", 10)
    assert pending(client, shard_of("unread:1", buf.shards)) == {"unread:1": 1}  # nothing lost


def test_move_reraises_other_script_errors(buf):
    def failing(keys=(), args=()):
        raise ResponseError("ERR something else")

    buf._move = failing
    with pytest.raises(ResponseError, match="something else"):
        buf.move(0, "b1", 10)
