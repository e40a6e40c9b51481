"""counters.base.registry: register, get_spec, parse_member, CounterSpec."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError

from counters.base import registry
from counters.base.exceptions import CountersError, UnknownCounter
from counters.base.registry import CounterSpec, get_spec, parse_member, register
from notifications.models import UnreadCounter


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    """Registrations of a test vanish after it; the app's own ones stay visible."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def test_app_registers_the_unread_counter():
    expected = CounterSpec(
        "unread", "notifications.UnreadCounter", "user", "count", non_negative=True
    )
    assert get_spec("unread") == expected


def test_register_returns_the_spec_and_get_spec_finds_it():
    spec = register("likes", "auth.User", key_field="username", value_field="id")
    assert spec == CounterSpec("likes", "auth.User", "username", "id")
    assert get_spec("likes") is spec
    assert spec in registry.all_specs()


def test_register_defaults_to_primary_key_and_count():
    spec = register("rows", "notifications.UnreadCounter")
    assert (spec.key_field, spec.value_field) == ("pk", "count")
    assert spec.key_model_field is UnreadCounter._meta.pk


def test_register_accepts_a_model_class():
    assert register("users", User).model_label == "auth.User"
    assert get_spec("users").model is User


def test_registering_the_same_spec_twice_is_harmless():
    first = register("likes", "auth.User", key_field="username")
    second = register("likes", User, key_field="username")
    assert second is first
    assert [s.name for s in registry.all_specs()].count("likes") == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": "notifications.UnreadCounter"},
        {"model": "auth.User", "key_field": "email"},
        {"model": "auth.User", "key_field": "username", "value_field": "other"},
    ],
    ids=["model", "key_field", "value_field"],
)
def test_conflicting_registration_raises_and_keeps_the_first(kwargs):
    first = register("likes", "auth.User", key_field="username")
    with pytest.raises(ValueError, match="counter 'likes' is already registered as"):
        register("likes", **kwargs)
    assert get_spec("likes") is first


@pytest.mark.parametrize("name", ["a:b", ":a", "a:"], ids=["middle", "start", "end"])
def test_colon_in_name_is_rejected(name):
    with pytest.raises(ValueError, match="must not contain ':'"):
        register(name, "auth.User")
    assert name not in {s.name for s in registry.all_specs()}


def test_unknown_counter_carries_its_name():
    with pytest.raises(UnknownCounter) as info:
        get_spec("nope")
    assert info.value.name == "nope"
    assert str(info.value) == "no counter named 'nope' is registered"
    assert isinstance(info.value, CountersError)
    assert isinstance(info.value, LookupError)
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__ is True


def test_spec_member_and_foreign_key_details():
    spec = get_spec("unread")
    assert spec.member(42) == "unread:42"
    assert spec.model is UnreadCounter
    assert spec.key_attname == "user_id"
    assert spec.target_model is User


def test_plain_key_field_has_no_target_model():
    spec = register("likes", "auth.User", key_field="username")
    assert spec.key_attname == "username"
    assert spec.target_model is None


@pytest.mark.parametrize("member", ["unread:42", b"unread:42"], ids=["str", "bytes"])
def test_parse_member_returns_spec_and_typed_key(member):
    spec, key = parse_member(member)
    assert spec is get_spec("unread")
    assert key == 42
    assert type(key) is int


def test_parse_member_keeps_colons_of_the_key():
    spec = register("likes", "auth.User", key_field="username")
    assert parse_member("likes:a:b") == (spec, "a:b")
    assert parse_member(spec.member("x:y")) == (spec, "x:y")


def test_parse_member_of_unknown_counter():
    with pytest.raises(UnknownCounter) as info:
        parse_member("gone:1")
    assert info.value.name == "gone"


def test_parse_member_with_invalid_key_raises_validation_error():
    with pytest.raises(ValidationError):
        parse_member("unread:abc")
