"""Schemathesis against the served OpenAPI document: no 500s, no response that breaks the schema.

Valid and invalid requests are generated for every operation and sent,
logged in with a session and a CSRF token, to the project's WSGI application.
A stateful run follows the document's links (list → read → unread → delete).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import schemathesis
from django.conf import settings
from django.contrib import auth
from django.contrib.sessions.backends.db import SessionStore
from django.core.wsgi import get_wsgi_application
from django.utils import timezone
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from hypothesis.stateful import run_state_machine_as_test

from notifications.models import Notification
from tests.helpers import assert_exact
from tests.web.conftest import notify

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

SETTINGS = hypothesis_settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


# Loaded at collection: serving the document touches no database.
schema = schemathesis.openapi.from_wsgi("/api/openapi.json", get_wsgi_application())


# Cases are built while collecting, before any database exists, so the
# session they carry has a fixed key; the `session` fixture logs alice in under it.
SESSION_KEY = "schemathesis0session0key0fixed00"
CSRF_TOKEN = "schemathesis0csrf0token0fixed000"


@schema.auth(refresh_interval=None)
class SessionAuth:
    """Session cookie and CSRF header, as a browser sends them after logging in."""

    def get(self, case, context) -> dict[str, str]:
        return {settings.SESSION_COOKIE_NAME: SESSION_KEY, settings.CSRF_COOKIE_NAME: CSRF_TOKEN}

    def set(self, case, data: dict[str, str], context) -> None:
        case.cookies = {**(case.cookies or {}), **data}
        case.headers = {**(case.headers or {}), "X-CSRFToken": CSRF_TOKEN}


@pytest.fixture
def session(alice, bob) -> None:
    """Log alice in under SESSION_KEY; she has read and unread notifications, bob has some too."""
    inboxes(alice, bob)
    data = {
        auth.SESSION_KEY: str(alice.pk),
        auth.BACKEND_SESSION_KEY: "django.contrib.auth.backends.ModelBackend",
        auth.HASH_SESSION_KEY: alice.get_session_auth_hash(),
    }
    SessionStore.get_model_class().objects.create(
        session_key=SESSION_KEY,
        session_data=SessionStore().encode(data),
        expire_date=timezone.now() + timedelta(hours=1),
    )


@schema.parametrize()
@SETTINGS
def test_every_operation_conforms(case, session, alice, bob):
    case.call_and_validate()
    assert_exact(alice, bob, flush=False)


def inboxes(alice, bob) -> None:
    """Alice has 5 unread and 2 read notifications, bob 3 unread, and neither anything else,
    whatever a scenario before read or deleted."""
    Notification.objects.filter(recipient__in=[alice, bob]).delete()
    notify(alice, 5)
    notify(alice, 2, is_read=True)
    notify(bob, 3)


def test_linked_operations_conform(session, alice, bob):
    # HEAD operations answer without a body, so no link leads on from them; the
    # stateless test above covers them.
    class Machine(schema.exclude(method="HEAD").as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            # Each scenario starts from the same inboxes. Hypothesis replays a scenario's
            # first steps and expects the same draws: responses shaped by what an earlier
            # scenario deleted would change them (its FlakyStrategyDefinition).
            inboxes(alice, bob)

    run_state_machine_as_test(
        Machine,
        settings=hypothesis_settings(
            max_examples=25,
            stateful_step_count=6,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert_exact(alice, bob)
