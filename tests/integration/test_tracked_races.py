"""Sixteen threads racing the same change of a tracked row count it once (PostgreSQL row locks)."""

from __future__ import annotations

import itertools
import threading

import pytest
from django.db import connection  # noqa: F401 (read by the skipif condition)
from django.db.models import F

from tests import helpers
from tests.blog.models import Comment, Post
from tests.blog.truth import assert_exact

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="needs PostgreSQL row locks"),
    pytest.mark.usefixtures("redis_backend"),
]

THREADS = 16


def race(target):
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
    results = race(lambda i: Comment.objects.filter(pk=c.pk, approved=False).update(approved=True))
    assert sorted(results) == [0] * (THREADS - 1) + [1]
    assert_exact(*posts)


def test_racing_stale_saves_count_the_change_once(posts):
    c = Comment.objects.create(post=posts[0], approved=False, points=3)
    stale = [Comment.objects.get(pk=c.pk) for _ in range(THREADS)]

    def save(i):
        obj = stale[i]
        obj.approved, obj.post = True, posts[1]
        obj.save()

    race(save)
    assert_exact(*posts)


def test_racing_expression_updates_and_moves_stay_exact(posts):
    comments = [Comment.objects.create(post=posts[0], approved=True, points=1) for _ in range(4)]

    def work(i):
        qs = Comment.objects.filter(pk=comments[i % 4].pk)
        if i % 3 == 0:
            return qs.update(points=F("points") * 2)
        if i % 3 == 1:
            return qs.update(post=posts[i % 2], approved=i % 4 != 1)
        return qs.update(points=F("points") - 1)

    race(work)
    assert_exact(*posts)


def test_racing_deletes_of_one_row_count_it_once(posts):
    c = Comment.objects.create(post=posts[0], approved=True, points=5)
    Comment.objects.create(post=posts[0], approved=True, points=1)
    stale = [Comment.objects.get(pk=c.pk) for _ in range(THREADS)]

    def delete(i):
        if i % 2:
            return stale[i].delete()[0]
        return Comment.objects.filter(pk=c.pk).delete()[0]

    assert sum(race(delete)) == 1
    assert_exact(*posts)


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

    race(work)
    from counters import flush

    flush()
    assert not Post.objects.filter(pk=doomed.pk).exists()
    from tests.blog.models import PostStats

    assert not PostStats.objects.filter(pk=doomed.pk).exists()
    assert_exact(posts[1])
