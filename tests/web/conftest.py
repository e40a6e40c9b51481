"""Fixtures for the inbox page, the JSON API and the admin."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.test import Client

from notifications.models import Notification

PASSWORD = "correct horse battery staple"


@pytest.fixture
def make_member(django_user_model) -> Callable:
    """Users who can log in with PASSWORD."""

    def make(username: str, **extra):
        return django_user_model.objects.create_user(username, password=PASSWORD, **extra)

    return make


@pytest.fixture
def alice(make_member):
    return make_member("alice")


@pytest.fixture
def bob(make_member):
    return make_member("bob")


@pytest.fixture
def logged_in() -> Callable[..., Client]:
    """A test client logged in as a user (CSRF enforced if asked)."""

    def login(user, *, enforce_csrf_checks: bool = False) -> Client:
        client = Client(enforce_csrf_checks=enforce_csrf_checks)
        client.force_login(user)
        return client

    return login


def notify(user, count: int = 1, **fields) -> list[Notification]:
    """Create notifications one by one through the counted ``create()`` path."""
    verb = fields.pop("verb", None)
    return [
        Notification.objects.create(recipient=user, verb=verb or f"event {i}", **fields)
        for i in range(count)
    ]
