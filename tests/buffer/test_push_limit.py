"""Buffer.push on fakeredis: sums that would reach 2**53, where scores stop being exact."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest

from counters.base.exceptions import ScoreLimitExceeded, StalePush, UnexpectedScriptReply
from counters.buffer import intake
from counters.buffer.store import SCORE_LIMIT, Buffer

PREFIX = "t"
# With 4 shards: c:1 and c:3 live in shard 0, c:5 in shard 1, c:2 in shard 2.
NEAR = SCORE_LIMIT - 10


@pytest.fixture
def buf(client) -> Buffer:
    return Buffer(client, PREFIX, shards=4)


def pending(client, shard: int) -> dict[str, int]:
    # Scores read back as text and parsed as integers: no float rounding in the test.
    rows = client.zrange(
        f"{PREFIX}:{{s{shard}}}:pending", 0, -1, withscores=True, score_cast_func=int
    )
    return {m.decode(): s for m, s in rows}


def test_the_limit_is_two_to_the_53():
    assert SCORE_LIMIT == 2**53 == 9007199254740992


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
def test_sums_up_to_one_below_the_limit_are_kept_exactly(buf, client, sign):
    assert buf.push({"c:1": sign * NEAR}, "p1") == {0}
    assert buf.push({"c:1": sign * 9, "c:3": sign * 3}, "p2") == {0}
    assert pending(client, 0) == {"c:1": sign * (SCORE_LIMIT - 1), "c:3": sign * 3}


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
def test_a_shard_where_a_sum_would_reach_the_limit_adds_nothing(buf, client, sign):
    buf.push({"c:1": sign * NEAR}, "p1")
    with pytest.raises(ScoreLimitExceeded) as info:
        buf.push({"c:1": sign * 10, "c:3": sign * 3}, "p2")
    assert (info.value.push_id, info.value.members, info.value.shards) == (
        "p2",
        {"c:1": sign * 10},
        set(),
    )
    assert pending(client, 0) == {"c:1": sign * NEAR}  # c:3 not added either
    assert not client.exists("t:{s0}:w:p2")  # no mark: the remainder can still apply


def test_the_remainder_pushed_again_with_the_same_id_applies_once(buf, client):
    buf.push({"c:1": NEAR}, "p1")
    with pytest.raises(ScoreLimitExceeded):
        buf.push({"c:1": 10, "c:3": 3, "c:2": 4}, "p2")
    assert pending(client, 2) == {"c:2": 4}  # shard 2 took its part of the push
    assert buf.push({"c:3": 3, "c:2": 4}, "p2") == {0}
    assert buf.push({"c:3": 3, "c:2": 4}, "p2") == set()  # a repeat adds nothing twice
    assert pending(client, 0) == {"c:1": NEAR, "c:3": 3}
    assert pending(client, 2) == {"c:2": 4}


@pytest.mark.parametrize("delta", [SCORE_LIMIT, -SCORE_LIMIT, 2**60 + 3], ids=str)
def test_a_delta_at_the_limit_is_never_sent_and_its_shard_takes_the_rest(buf, client, delta):
    with pytest.raises(ScoreLimitExceeded) as info:
        buf.push({"c:1": delta, "c:3": 3, "c:2": 4}, "p1")
    assert (info.value.members, info.value.shards) == ({"c:1": delta}, {0, 2})
    assert pending(client, 0) == {"c:3": 3}
    assert pending(client, 2) == {"c:2": 4}
    assert buf.push({"c:3": 3, "c:2": 4}, "p1") == set()


def test_every_member_over_the_limit_is_named(buf, client):
    buf.push({"c:1": NEAR, "c:5": -NEAR}, "p1")
    with pytest.raises(ScoreLimitExceeded) as info:
        buf.push({"c:1": 11, "c:3": 1, "c:5": -12, "c:2": 2**53 + 1}, "p2")
    assert info.value.members == {"c:1": 11, "c:5": -12, "c:2": 2**53 + 1}
    assert info.value.shards == set()
    assert pending(client, 0) == {"c:1": NEAR}
    assert pending(client, 1) == {"c:5": -NEAR}


def test_a_push_fenced_or_already_applied_is_not_checked_again(buf, client):
    buf.push({"c:1": NEAR}, "p1")
    assert buf.fence(["c:1"], "p2") == set()
    assert buf.push({"c:1": 10}, "p2") == set()
    assert pending(client, 0) == {"c:1": NEAR}


def test_a_stale_push_is_refused_before_the_limit_is_checked(buf, client, monkeypatch):
    buf.push({"c:1": NEAR}, "p1")
    real_ns = intake.time.time_ns  # the writer's clock an hour behind Redis's
    monkeypatch.setattr(intake, "time", SimpleNamespace(time_ns=lambda: real_ns() - 3600 * 10**9))
    with pytest.raises(StalePush):
        buf.push({"c:1": 10}, "p2")
    assert pending(client, 0) == {"c:1": NEAR}


@pytest.mark.parametrize(
    "reply",
    [[3], [3, b"c:9"], [4, b"c:1"], 7, b"1"],
    ids=["no-members", "member-not-pushed", "unknown-code-list", "unknown-code", "bytes"],
)
def test_an_unknown_reply_raises(buf, reply):
    with (
        mock.patch.object(buf, "_run", return_value=[reply]),
        pytest.raises(UnexpectedScriptReply) as info,
    ):
        buf.push({"c:1": 1}, "p1")
    assert info.value.script == "PUSH_SCRIPT"
