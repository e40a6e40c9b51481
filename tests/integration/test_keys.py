"""A key is one counter whatever its Python type: "7" and 7 never collide, bad keys never buffer."""

from __future__ import annotations

import pytest
from django.db import transaction

import counters
from counters import api
from counters.exceptions import InvalidKey
from notifications.apps import UNREAD_COUNTER
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def _redis_keys(client, prefix: str) -> list[bytes]:
    return sorted(client.scan_iter(match=f"{prefix}:*", count=1000))


def _pending_members(prefix: str) -> dict[str, int]:
    buffer = api.get_buffer()
    members: dict[str, int] = {}
    for shard in range(buffer.shards):
        for member, score in buffer.client.zrange(
            buffer.key(shard, "pending"), 0, -1, withscores=True
        ):
            members[member.decode()] = int(score)
    return members


def _notifications(user, unread: int) -> None:
    for _ in range(unread):
        Notification.objects.create(recipient=user, verb="v")


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param("everyone", id="alice-and-bob-rows"),
        pytest.param("bob", id="bob-rows-only"),
    ],
)
def test_update_to_a_str_recipient_id_moves_the_counts(make_user, rows):
    alice, bob = make_user(), make_user()
    _notifications(alice, 2)
    _notifications(bob, 3)
    counters.flush()
    qs = (
        Notification.objects.all()
        if rows == "everyone"
        else Notification.objects.filter(recipient=bob)
    )
    qs.update(recipient_id=str(alice.pk))
    assert (truth(alice), truth(bob)) == (5, 0)
    assert_exact(alice, bob)
    assert (stored(alice), stored(bob)) == (5, 0)


def test_update_to_the_same_recipient_as_str_emits_nothing(
    make_user, redis_client, counters_prefix
):
    alice = make_user()
    _notifications(alice, 3)
    counters.flush()
    before = _redis_keys(redis_client, counters_prefix)
    assert Notification.objects.filter(recipient=alice).update(recipient_id=str(alice.pk)) == 3
    assert _pending_members(counters_prefix) == {}
    assert _redis_keys(redis_client, counters_prefix) == before  # not even a push marker
    assert_exact(alice)


def test_save_with_a_str_recipient_id_is_one_recipient(make_user):
    alice, bob = make_user(), make_user()
    n = Notification.objects.create(recipient=alice, verb="v")
    n.recipient_id = str(alice.pk)
    n.save()
    n.recipient_id = str(bob.pk)
    n.save()
    Notification.objects.bulk_create(
        [Notification(recipient_id=str(bob.pk), verb="v"), Notification(recipient_id=bob.pk)]
    )
    assert (truth(alice), truth(bob)) == (0, 3)
    assert_exact(alice, bob)


def test_get_count_of_a_str_key_equals_the_int_key(make_user):
    alice = make_user()
    _notifications(alice, 2)
    counters.flush()  # two stored ...
    _notifications(alice, 1)  # ... and one pending
    expected = truth(alice)
    assert expected == 3
    assert UnreadCounter.objects.get_count(str(alice.pk)) == expected
    assert UnreadCounter.objects.get_count(alice.pk) == expected
    assert counters.get_value(UNREAD_COUNTER, str(alice.pk)) == expected


def test_get_values_keeps_the_callers_keys(make_user):
    alice, bob = make_user(), make_user()
    _notifications(alice, 2)
    counters.flush()
    _notifications(bob, 1)
    keys = [alice.pk, str(alice.pk), str(bob.pk), f" {bob.pk}"]
    assert counters.get_values(UNREAD_COUNTER, keys) == {
        alice.pk: truth(alice),
        str(alice.pk): truth(alice),
        str(bob.pk): truth(bob),
        f" {bob.pk}": truth(bob),
    }
    assert counters.get_parts(UNREAD_COUNTER, [str(alice.pk)]) == {str(alice.pk): (2, 0)}


def test_deltas_of_keys_that_normalise_equal_add_up(make_user):
    alice = make_user()
    counters.add_many(UNREAD_COUNTER, {alice.pk: 2, str(alice.pk): 3})
    with transaction.atomic():
        counters.add(UNREAD_COUNTER, alice.pk, 1)
        counters.add(UNREAD_COUNTER, str(alice.pk), 1)
    assert counters.get_value(UNREAD_COUNTER, alice.pk) == 7
    counters.flush()
    assert stored(alice) == 7


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("instance", id="model-instance"),
        pytest.param("abc", id="not-a-number"),
        pytest.param(None, id="none"),
    ],
)
@pytest.mark.parametrize("in_transaction", [False, True], ids=["autocommit", "atomic"])
def test_invalid_key_is_refused_at_add_and_buffers_nothing(
    make_user, redis_client, counters_prefix, bad, in_transaction
):
    alice = make_user()
    key = alice if bad == "instance" else bad
    if in_transaction:
        with transaction.atomic():
            counters.add(UNREAD_COUNTER, alice.pk, 1)
            with pytest.raises(InvalidKey) as info:
                counters.add(UNREAD_COUNTER, key, 1)
            with pytest.raises(InvalidKey):
                counters.add_many(UNREAD_COUNTER, {alice.pk: 1, key: 1})
    else:
        with pytest.raises(InvalidKey) as info:
            counters.add(UNREAD_COUNTER, key, 1)
    assert (info.value.counter, info.value.key) == (UNREAD_COUNTER, key)
    if bad == "instance":
        assert "pass obj.pk" in str(info.value)
    expected = {f"unread:{alice.pk}": 1} if in_transaction else {}
    assert _pending_members(counters_prefix) == expected
    result = counters.flush()
    assert (result.failed_shards, result.dropped) == ({}, 0)
    assert stored(alice) == (1 if in_transaction else 0)
