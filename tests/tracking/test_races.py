"""Racing requests count a change once (PostgreSQL: real row locks between connections).

Sixteen threads race the same change: of a notification (the unread counts),
then of a tracked row of the blog (its comment counts and points).
"""

from __future__ import annotations

import itertools
import threading

import pytest
from django.db import connection
from django.db.models import F

from notifications.models import Notification, UnreadCounter
from tests import helpers
from tests.blog.models import Comment, Post
from tests.blog.truth import assert_exact as assert_blog_exact
from tests.conftest import has_row_locks
from tests.helpers import assert_exact, stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.skipif(not has_row_locks(), reason="needs row locks between connections"),
    pytest.mark.usefixtures("redis_backend"),
]


THREADS = 16


# -- notifications ---------------------------------------------------------------------


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


# -- a tracked row of the blog ---------------------------------------------------------


def race_each(target):
    """Run ``target(i)`` for i in 0..THREADS-1 in threads released at the same instant."""

    def run(i, barrier):
        barrier.wait(timeout=10)
        return target(i)

    return helpers.race(THREADS, run, timeout=60)


@pytest.fixture
def posts():
    return [Post.objects.create(title=str(i)) for i in range(2)]


def test_racing_conditional_updates_approve_once(posts):
    c = Comment.objects.create(post=posts[0], approved=False, points=7)
    results = race_each(
        lambda i: Comment.objects.filter(pk=c.pk, approved=False).update(approved=True)
    )
    assert sorted(results) == [0] * (THREADS - 1) + [1]
    assert_blog_exact(*posts)


def test_racing_stale_saves_count_the_change_once(posts):
    c = Comment.objects.create(post=posts[0], approved=False, points=3)
    stale = [Comment.objects.get(pk=c.pk) for _ in range(THREADS)]

    def save(i):
        obj = stale[i]
        obj.approved, obj.post = True, posts[1]
        obj.save()

    race_each(save)
    assert_blog_exact(*posts)


def test_racing_expression_updates_and_moves_stay_exact(posts):
    comments = [Comment.objects.create(post=posts[0], approved=True, points=1) for _ in range(4)]

    def work(i):
        qs = Comment.objects.filter(pk=comments[i % 4].pk)
        if i % 3 == 0:
            return qs.update(points=F("points") * 2)
        if i % 3 == 1:
            return qs.update(post=posts[i % 2], approved=i % 4 != 1)
        return qs.update(points=F("points") - 1)

    race_each(work)
    assert_blog_exact(*posts)


def test_racing_deletes_of_one_row_count_it_once(posts):
    c = Comment.objects.create(post=posts[0], approved=True, points=5)
    Comment.objects.create(post=posts[0], approved=True, points=1)
    stale = [Comment.objects.get(pk=c.pk) for _ in range(THREADS)]

    def delete(i):
        if i % 2:
            return stale[i].delete()[0]
        return Comment.objects.filter(pk=c.pk).delete()[0]

    assert sum(race_each(delete)) == 1
    assert_blog_exact(*posts)


def test_racing_saves_and_a_cascade_never_bring_a_counter_back(posts):
    doomed = posts[0]
    comments = [Comment.objects.create(post=doomed, approved=True, points=2) for _ in range(3)]
    stale = itertools.cycle([Comment.objects.get(pk=c.pk) for c in comments])
    lock = threading.Lock()

    def work(i):
        if i == 0:
            return Post.objects.filter(pk=doomed.pk).delete()
        with lock:
            obj = next(stale)
        obj.points = 10
        try:
            obj.save(update_fields=["points"])
        except Exception as exc:  # the row is gone: Django says so
            return type(exc).__name__
        return "saved"

    race_each(work)
    from counters import flush

    flush()
    assert not Post.objects.filter(pk=doomed.pk).exists()
    from tests.blog.models import PostStats

    assert not PostStats.objects.filter(pk=doomed.pk).exists()
    assert_blog_exact(posts[1])
