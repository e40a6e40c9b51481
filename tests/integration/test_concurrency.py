"""Racing requests count a change once (PostgreSQL: real row locks between connections)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="needs PostgreSQL row locks"),
    pytest.mark.usefixtures("redis_backend"),
]

THREADS = 16


def race(target, *args):
    """Run ``target(*args)`` in THREADS threads released at the same instant."""
    barrier = threading.Barrier(THREADS)
    results, errors = [], []

    def run():
        try:
            barrier.wait(timeout=10)
            results.append(target(*args))
        except Exception as exc:  # pragma: no cover - reported by the assertion
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    return results


def test_sixteen_threads_marking_one_notification_read_decrement_once(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="keep")
    target = Notification.objects.create(recipient=alice, verb="raced")
    import counters

    counters.flush()
    assert stored(alice) == 2

    def mark(pk):
        return Notification.objects.get(pk=pk).mark_read()

    results = race(mark, target.pk)
    assert sorted(results) == [False] * (THREADS - 1) + [True]
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 1
    assert_exact(alice)


def test_stale_instances_saved_by_racing_threads_decrement_once(make_user):
    alice = make_user()
    n = Notification.objects.create(recipient=alice, verb="stale")
    stale = [Notification.objects.get(pk=n.pk) for _ in range(THREADS)]
    it = iter(stale)
    lock = threading.Lock()

    def save():
        with lock:
            obj = next(it)
        obj.is_read = True
        obj.save()

    race(save)
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 0
    assert_exact(alice)


def test_racing_mark_all_read_and_mark_unread_stay_exact(make_user):
    alice = make_user()
    notes = [Notification.objects.create(recipient=alice, verb=str(i)) for i in range(10)]
    counter = iter(range(THREADS))
    lock = threading.Lock()

    def work():
        with lock:
            i = next(counter)
        if i % 2:
            return Notification.objects.filter(recipient=alice).mark_all_read()
        return Notification.objects.get(pk=notes[i % 10].pk).mark_unread()

    race(work)
    assert UnreadCounter.objects.get_count(alice) == truth(alice)
    assert_exact(alice)
