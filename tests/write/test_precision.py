"""Counts at and beyond 2**53 stay exact: Redis scores are doubles, so such sums go to the DB.

Real Redis and the configured database. Expected values are Python ints
computed from the deltas added.
"""

from __future__ import annotations

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

import counters
from counters.buffer.store import SCORE_LIMIT, Buffer
from counters.models import FlushBatch
from counters.verify.rebuild import rebuild
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

# One push after each COMMIT: what these tests follow is that push (the sender would merge it).
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("per_commit"),
]

UNREAD = "unread"


def pending(user) -> int:
    """The user's delta buffered in Redis (read as text, so never rounded by the test)."""
    member = f"{UNREAD}:{user.pk}"
    return counters.get_buffer().snapshot([member]).pending[member]


def exact(key) -> int:
    """stored + buffered, as is: "unread" reads clamp below zero, these values do not."""
    return sum(counters.get_parts(UNREAD, [key])[key])


def fallback_rows() -> list[tuple[int, int, int, object]]:
    rows = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK)
    return sorted(rows.values_list("keys", "deltas", "dropped", "unsettled"), key=str)


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
def test_a_huge_delta_on_top_of_a_pending_one_loses_nothing(make_user, sign):
    alice = make_user()
    counters.add(UNREAD, alice.pk, sign * 3)
    counters.add(UNREAD, alice.pk, sign * 2**60)
    expected = sign * (2**60 + 3)
    assert exact(alice.pk) == expected
    assert pending(alice) == sign * 3  # the huge delta never entered Redis
    assert fallback_rows() == [(1, 2**60, 0, None)]  # a settled direct write
    counters.flush()
    value = UnreadCounter.objects.get(user=alice).count
    assert (type(value), value) == (int, expected)
    assert exact(alice.pk) == expected


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
def test_many_adds_that_carry_a_pending_sum_across_2_to_the_53(make_user, sign):
    alice, bob = make_user(), make_user()
    step = sign * (2**48 + 7)  # odd: a double beyond 2**53 cannot hold the sum
    for _ in range(40):
        counters.add_many(UNREAD, {alice.pk: step, bob.pk: sign})
    expected = 40 * step
    assert expected * sign > SCORE_LIMIT
    assert exact(alice.pk) == expected
    assert pending(alice) == 31 * step  # the 32nd add would have reached 2**53
    assert stored(alice) == 9 * step
    assert exact(bob.pk) == pending(bob) == 40 * sign
    counters.flush()
    assert stored(alice) == exact(alice.pk) == expected
    assert stored(bob) == 40 * sign
    counters.add(UNREAD, alice.pk, -expected)
    counters.flush()
    assert stored(alice) == exact(alice.pk) == 0


def test_a_rebuild_repairs_a_drift_beyond_2_to_the_53_exactly(make_user):
    alice = make_user()
    for _ in range(3):
        Notification.objects.create(recipient=alice, verb="v")
    counters.flush()
    drift = 2**60 + 101  # nearest doubles are 2**60 and 2**60 + 256
    UnreadCounter.objects.filter(user=alice).update(count=3 + drift)  # raw SQL: drift
    Notification.objects.create(recipient=alice, verb="buffered")
    report = rebuild(UNREAD, keys=[alice.pk], confirm_delay=0)
    assert (report.repaired, [d.error for d in report.wrong]) == (1, [drift])
    assert pending(alice) == 1
    assert exact(alice.pk) == truth(alice) == 4
    assert_exact(alice)


def test_a_lost_reply_after_a_refusal_adds_the_remainder_once(settings, make_user, monkeypatch):
    """A refused push's remainder runs in Redis but its reply is lost: the retry adds nothing."""
    settings.COUNTERS_SHARDS = 1  # alice and bob in one shard: one refusal holds both back
    alice, bob = make_user(), make_user()
    near = SCORE_LIMIT - 10
    counters.add(UNREAD, alice.pk, near)
    real_run = Buffer._run
    push_sha = counters.get_buffer()._push.sha
    push_calls = []

    def lose_second_push_reply(self, script, calls):
        replies = real_run(self, script, calls)
        if script.sha == push_sha:
            push_calls.append(calls)
            if len(push_calls) == 2:
                raise RedisTimeoutError("Timeout reading from socket (injected)")
        return replies

    monkeypatch.setattr(Buffer, "_run", lose_second_push_reply)
    counters.add_many(UNREAD, {alice.pk: 21, bob.pk: 5})  # 2**53 + 11: refused for alice
    assert exact(alice.pk) == near + 21
    assert len(push_calls) == 3  # refused, remainder (reply lost), repeat (ignored)
    assert pending(alice) == near
    assert exact(bob.pk) == pending(bob) == 5
    assert fallback_rows() == [(1, 21, 0, None)]
    counters.flush()
    assert (stored(alice), stored(bob)) == (near + 21, 5)
