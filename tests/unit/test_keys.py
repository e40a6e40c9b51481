"""Key normalisation: CounterSpec.normalize/member, InvalidKey, and the tracked totals per key."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User

from counters import registry
from counters.exceptions import CountersError, InvalidKey
from counters.registry import get_spec, register
from counters.tracking import get_tracker


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
