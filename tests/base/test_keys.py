"""A key is one counter whatever its Python type: "7" and 7 never collide, bad keys never buffer.

Key normalisation (CounterSpec.normalize/member, InvalidKey, the tracked totals per key), then
the same on real Redis and the database. A key that is not exactly a value of its field is
refused, by add() and reads alike: ``2.7`` used to be read and written as key 2 (``int()``
truncates), a counter other than the one meant. Text and ints are still converted (``"7"`` is
7), and a number equal to a value of the field (``2.0``) is that value.
"""

from __future__ import annotations

import uuid
from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.db import transaction

import counters
from counters.base import registry
from counters.base.exceptions import CountersError, InvalidKey
from counters.base.registry import get_spec, register
from counters.client import get_buffer
from counters.tracking.trackers import get_tracker
from notifications.apps import UNREAD_COUNTER
from notifications.models import Notification, UnreadCounter
from tests.blog.models import Comment, Post, PostStats
from tests.helpers import assert_exact, stored, truth

NAME = "post_comments"


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    """Registrations of a test vanish after it; the app's own ones stay visible."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        pytest.param(7, 7, id="int"),
        pytest.param("7", 7, id="str"),
        pytest.param(" 7 ", 7, id="padded-str"),
        pytest.param(b"7", 7, id="bytes"),
    ],
)
def test_integer_foreign_key_normalises_to_int(key, expected):
    spec = get_spec("unread")
    assert spec.normalize(key) == expected
    assert type(spec.normalize(key)) is int
    assert spec.member(key) == f"unread:{expected}"


def test_char_key_normalises_to_str():
    spec = register("likes", "auth.User", key_field="username")
    assert spec.normalize(5) == "5"
    assert spec.member(5) == spec.member("5") == "likes:5"


def test_uuid_key_member_round_trips():
    spec = register("uuids", "counters.FlushBatch", key_field="batch_id")
    value = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert spec.member(value) == spec.member(str(value))


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        pytest.param(User(pk=3, username="alice"), "pass obj.pk", id="model-instance"),
        pytest.param(None, "None is not a key", id="none"),
        pytest.param("abc", "must be an integer", id="not-a-number"),
        pytest.param("", "must be an integer", id="empty"),
        pytest.param(2**70, "less than or equal to", id="out-of-range"),
        pytest.param([1], "", id="list"),
    ],
)
def test_invalid_integer_keys_raise_invalid_key(key, reason):
    spec = get_spec("unread")
    with pytest.raises(InvalidKey) as info:
        spec.member(key)
    error = info.value
    assert (error.counter, error.key) == ("unread", key)
    assert reason in error.reason
    assert str(error).startswith(f"invalid key {key!r} for counter 'unread': ")
    assert isinstance(error, CountersError)
    assert isinstance(error, ValueError)


def test_model_instance_is_refused_even_for_a_char_key():
    spec = register("likes", "auth.User", key_field="username")
    with pytest.raises(InvalidKey, match=r"pass obj\.pk"):
        spec.normalize(User(username="alice"))


def test_too_long_char_key_is_refused():
    spec = register("likes", "auth.User", key_field="username")
    with pytest.raises(InvalidKey, match="at most 150 characters"):
        spec.normalize("x" * 151)


def test_long_key_is_shortened_in_the_message():
    with pytest.raises(InvalidKey) as info:
        get_spec("unread").normalize("y" * 1000)
    assert info.value.key == "y" * 1000
    assert len(str(info.value)) < 300


def test_tracked_totals_merge_recipient_ids_of_either_type():
    rows = [
        {"recipient_id": "5", "is_read": False},
        {"recipient_id": 5, "is_read": False},
        {"recipient_id": 5, "is_read": True},
        {"recipient_id": "6", "is_read": False},
        None,  # no row (before an insert, after a delete)
    ]
    totals = get_tracker("unread").totals(rows)
    assert totals == {5: 2, 6: 1}
    assert all(type(recipient) is int for recipient in totals)
    assert get_tracker("unread").deltas(rows[:2], rows[1:2]) == {5: -1}


# -- on real Redis and the database -------------------------------------------------


def _redis_keys(client, prefix: str) -> list[bytes]:
    return sorted(client.scan_iter(match=f"{prefix}:*", count=1000))


def _pending_members(prefix: str) -> dict[str, int]:
    buffer = get_buffer()
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


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
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


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
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


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
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


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
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


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
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


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_deltas_of_keys_that_normalise_equal_add_up(make_user):
    alice = make_user()
    counters.add_many(UNREAD_COUNTER, {alice.pk: 2, str(alice.pk): 3})
    with transaction.atomic():
        counters.add(UNREAD_COUNTER, alice.pk, 1)
        counters.add(UNREAD_COUNTER, str(alice.pk), 1)
    assert counters.get_value(UNREAD_COUNTER, alice.pk) == 7
    counters.flush()
    assert stored(alice) == 7


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("instance", id="model-instance"),
        pytest.param("abc", id="not-a-number"),
        pytest.param(None, id="none"),
    ],
)
@pytest.mark.parametrize("in_transaction", [False, True], ids=["autocommit", "atomic"])
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
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


# -- inexact keys (blog.PostStats.comments) --------------------------------------------


def post_truth(post: Post) -> int:
    return Comment.objects.filter(post=post, approved=True).count()


def post_stored(post: Post) -> int:
    row = PostStats.objects.filter(post=post).values_list("comments", flat=True).first()
    return row or 0


@pytest.fixture
def post() -> Post:
    """A post with pk 2 and two approved comments, flushed; then one more, buffered."""
    Post.objects.create(pk=1)
    post = Post.objects.create(pk=2)
    for _ in range(2):
        Comment.objects.create(post=post, approved=True)
    counters.flush()
    Comment.objects.create(post=post, approved=True)
    return post


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.parametrize(
    "key",
    [
        pytest.param(2.7, id="float"),
        pytest.param(1.5, id="float-half"),
        pytest.param(Decimal("2.5"), id="decimal"),
        pytest.param(float("inf"), id="infinity"),
        pytest.param(float("nan"), id="nan"),
    ],
)
def test_an_inexact_key_is_refused_by_add_and_reads(post, key):
    with pytest.raises(InvalidKey) as info:
        counters.get_value(NAME, key)
    assert (info.value.counter, info.value.key) == (NAME, key)
    with pytest.raises(InvalidKey):
        counters.get_values(NAME, [post.pk, key])
    with transaction.atomic():
        with pytest.raises(InvalidKey):
            counters.add(NAME, key, 5)
        with pytest.raises(InvalidKey):
            counters.add_many(NAME, {post.pk: 1, key: 5})  # nothing of the call is recorded
    assert (post_truth(post), counters.get_value(NAME, post.pk)) == (3, 3)
    counters.flush()
    assert (post_truth(post), counters.get_value(NAME, post.pk), post_stored(post)) == (3, 3, 3)
    assert post_stored(Post(pk=1)) == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_the_float_key_2_7_no_longer_reads_key_2(post):
    with pytest.raises(InvalidKey, match=r"not exactly a value of the key field \(it would be 2\)"):
        counters.get_value(NAME, 2.7)


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.parametrize(
    "key",
    [
        pytest.param(2, id="int"),
        pytest.param("2", id="str"),
        pytest.param(2.0, id="whole-float"),
        pytest.param(Decimal("2"), id="whole-decimal"),
    ],
)
def test_an_exact_key_reads_and_adds_its_counter(post, key):
    assert counters.get_value(NAME, key) == 3
    assert registry.get_spec(NAME).member(key) == f"{NAME}:2"
