"""A push of one member is planned as the general loop plans it (``Intake.plan_push``)."""

from __future__ import annotations

import pytest

from counters.buffer.intake import PushPlan
from counters.buffer.keyspace import SCORE_LIMIT
from counters.buffer.pushids import PushId
from counters.buffer.store import Buffer


@pytest.fixture
def buffer(client) -> Buffer:
    return Buffer(client, "plantest", shards=8)


def general(buffer: Buffer, deltas: dict, push_id) -> PushPlan:
    """The general loop's plan: a member with a zero delta is left out of the push."""
    return buffer.plan_push({**deltas, "zero:0": 0}, push_id)


def without_time(plan: PushPlan) -> list:
    return [(keys, args[:1] + args[2:]) for keys, args in plan.calls]


@pytest.mark.parametrize(
    "delta",
    [1, -1, 7, SCORE_LIMIT - 1, -(SCORE_LIMIT - 1), SCORE_LIMIT, -SCORE_LIMIT, 0, True, 2.0],
)
@pytest.mark.parametrize("push_id", [PushId("w-" + "b" * 16, 5), "w-cccc:9", "an-old-id"])
def test_one_member_is_planned_as_the_general_loop_plans_it(buffer, delta, push_id):
    for member in ("unread:7", "unread:123456789", "naïve:clé"):
        deltas = {member: delta}
        plan, expected = buffer.plan_push(deltas, push_id), general(buffer, deltas, push_id)
        assert plan.push_id == push_id and plan.deltas == deltas
        assert dict(plan.groups) == dict(expected.groups)
        assert plan.refused == expected.refused
        assert without_time(plan) == without_time(expected)
        for keys, args in plan.calls:
            assert type(keys) is tuple and all(type(a) is int for a in args[:4])
            assert type(args[5]) is int
