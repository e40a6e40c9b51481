"""The apply transaction runs under lock, statement and idle limits derived from the lease
and the time budget; the session's own settings are put back after the flush."""

from __future__ import annotations

from unittest import mock

import pytest
from django.db import connection

import counters
from counters import flusher
from counters.waits import MIN_IDLE, MIN_WAIT, Limits, apply_limits
from notifications.models import Notification
from tests.helpers import stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.mark.parametrize(
    ("lease", "remaining", "expected"),
    [
        (30, 100, Limits(lock=100, statement=100, idle=60)),
        (30, 5, Limits(lock=5, statement=30, idle=60)),
        (30, 0.01, Limits(lock=MIN_WAIT, statement=30, idle=MIN_IDLE)),
        (0.4, 5, Limits(lock=5, statement=5, idle=MIN_IDLE)),
        (0.4, 0.01, Limits(lock=MIN_WAIT, statement=MIN_WAIT, idle=MIN_IDLE)),
        (120, 10, Limits(lock=10, statement=120, idle=240)),
    ],
    ids=str,
)
def test_limits_come_from_the_lease_and_the_budget(lease, remaining, expected):
    assert apply_limits(lease, remaining) == expected


UNITS_MS = {"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000}


def as_ms(setting: str) -> int:
    """A PostgreSQL duration setting as shown ("19987ms", "20s", "1min") in milliseconds."""
    number = setting.rstrip("abcdefghijklmnopqrstuvwxyz")
    return int(number) * UNITS_MS[setting[len(number) :]]


def session_settings() -> tuple:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), "
                "current_setting('idle_in_transaction_session_timeout')"
            )
            return cursor.fetchone()
        cursor.execute("PRAGMA busy_timeout")
        return cursor.fetchone()


def test_the_apply_transaction_runs_under_the_limits(settings, make_user):
    settings.COUNTERS_LEASE_TIMEOUT = 8
    users = [make_user() for _ in range(6)]
    Notification.objects.notify(users, verb="v")
    before = session_settings()
    seen: list[tuple] = []
    real = flusher.apply_deltas

    def spy(deltas, using):
        seen.append(session_settings())
        return real(deltas, using)

    with mock.patch.object(flusher, "apply_deltas", spy):
        counters.flush(time_budget=20)
    assert seen
    if connection.vendor == "postgresql":
        # Locks: the budget left (just under 20 s); statements: that, or the 8 s lease if
        # longer; idle: twice the lease, at least 60 s.
        for lock, statement, idle in seen:
            assert 19_000 < as_ms(lock) <= 20_000
            assert as_ms(statement) == as_ms(lock)
            assert as_ms(idle) == 60_000
    else:
        assert all(19_000 < busy <= 20_000 for (busy,) in seen), seen
    assert session_settings() == before  # put back after the flush
    assert [stored(u) for u in users] == [truth(u) for u in users] == [1] * 6
