"""Redis unreachable while writing: deltas go straight to the DB; nothing is lost."""

from __future__ import annotations

import pytest

import counters
from counters import api
from counters.exceptions import BufferUnavailable
from counters.models import FlushBatch
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def short_timeouts(settings):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5


def test_writes_while_redis_is_killed_fall_back_to_the_db(own_redis, settings, make_user):
    alice, bob = make_user(), make_user()
    first = Notification.objects.create(recipient=alice, verb="before")
    Notification.objects.create(recipient=bob, verb="before")
    assert UnreadCounter.objects.get_count(alice) == 1
    counters.flush()
    Notification.objects.create(recipient=alice, verb="buffered, then lost with Redis")

    own_redis.kill()
    fallbacks = api.fallback_count
    second = Notification.objects.create(recipient=alice, verb="during")
    Notification.objects.create(recipient=bob, verb="during")
    assert first.mark_read() is True
    assert Notification.objects.filter(recipient=bob).mark_all_read() == 2
    second.delete()
    assert api.fallback_count - fallbacks == 5
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count() == 5
    # every change made while Redis was down is in the rows already
    assert stored(bob) == truth(bob) == 0

    own_redis.start()  # back, empty: the one delta buffered before the kill is gone
    assert stored(alice) == truth(alice) - 1
    UnreadCounter.objects.filter(user=alice).update(count=truth(alice))  # what a rebuild does
    Notification.objects.create(recipient=alice, verb="after")
    assert_exact(alice, bob)


def test_unreachable_redis_url_never_fails_the_write(settings, make_user):
    settings.COUNTERS_REDIS_URL = "redis://127.0.0.1:1/0"
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    alice = make_user()
    notes = [Notification.objects.create(recipient=alice, verb=str(i)) for i in range(3)]
    assert notes[0].mark_read() is True
    assert stored(alice) == truth(alice) == 2
    # reads degrade to the rows, which hold every change made while Redis is down
    assert UnreadCounter.objects.get_count(alice) == 2
    with pytest.raises(BufferUnavailable) as info:
        counters.flush()
    assert info.value.url == "redis://127.0.0.1:1/0"
