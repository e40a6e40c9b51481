"""ATOMIC_REQUESTS and a 100,000-recipient fan-out."""

from __future__ import annotations

import tracemalloc

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

import counters
from counters.client import get_buffer
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.fixture
def atomic_requests(settings):
    settings.ROOT_URLCONF = "tests.urls_atomic"
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    yield
    connection.settings_dict["ATOMIC_REQUESTS"] = False


def test_atomic_request_sends_its_deltas_after_the_response_commits(
    atomic_requests, client, make_user
):
    alice = make_user()
    assert client.get(f"/notify/{alice.pk}/ok/").status_code == 200
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 1
    assert_exact(alice)


def test_failed_atomic_request_sends_nothing(atomic_requests, client, make_user):
    alice = make_user()
    client.raise_request_exception = False
    assert client.get(f"/notify/{alice.pk}/fail/").status_code == 500
    assert Notification.objects.count() == 0
    assert UnreadCounter.objects.get_count(alice) == 0
    assert get_buffer().snapshot([f"unread:{alice.pk}"]).pending == {f"unread:{alice.pk}": 0}
    assert_exact(alice)


@pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="large fan-out measured on PostgreSQL"
)
def test_notify_100k_recipients_with_bounded_memory():
    User = get_user_model()
    User.objects.bulk_create([User(username=f"fan{i}") for i in range(100_000)], batch_size=5000)
    ids = User.objects.filter(username__startswith="fan").values_list("pk", flat=True).iterator()
    tracemalloc.start()
    try:
        created = Notification.objects.notify(ids, verb="maintenance", batch_size=2000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert created == 100_000
    # Rows go in batches of 2,000; what grows with the fan-out is one delta per
    # recipient (the aggregated outbox): about 25 MB for 100,000.
    assert peak < 50 * 1024 * 1024, peak  # measured: 25 MB
    assert counters.get_value("unread", User.objects.get(username="fan99999").pk) == 1
    result = counters.flush()
    assert result.keys == 100_000
    assert UnreadCounter.objects.filter(count=1).count() == 100_000
    some = User.objects.filter(username__in=["fan0", "fan50000", "fan99999"])
    assert [stored(u) for u in some] == [truth(u) for u in some] == [1, 1, 1]
