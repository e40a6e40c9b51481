"""Declarations track() accepts are counted exactly on real Redis and the database.

Counter rows with ``auto_now``/``auto_now_add`` columns are created by the
flush with the current time in them, as ``save()`` would, and ``auto_now``
moves on with every flush that adds to the row. (Before, the flush could not
insert such a row: it quarantined the delta and reads dropped it, 3 before
the flush and 0 after.)
"""

from __future__ import annotations

import datetime

import pytest
from django.db.models import Q
from django.utils import timezone

import counters
from counters.base import registry
from counters.tracking import trackers
from counters.write import apply
from tests.blog.models import Comment, DeclStamped, Post

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

NAME = "stamped_comments"


@pytest.fixture(autouse=True)
def stamped(monkeypatch):
    """Approved comments per post, counted into rows with time stamps, for this test alone."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_tracked_fields", "_attnames", "_names"):
        monkeypatch.setattr(trackers, name, dict(getattr(trackers, name)))
    counters.track(
        NAME, Comment, key="post", into="blog.DeclStamped.comments", where=Q(approved=True)
    )


@pytest.fixture(
    params=[pytest.param("native", id="native-applier"), pytest.param("generic", id="generic")]
)
def applier(request, monkeypatch) -> str:
    """The database's own applier, then the generic one (MySQL/MariaDB and others)."""
    if request.param == "generic":
        monkeypatch.setattr(apply, "APPLIERS", {})
    return request.param


def truth(post: Post) -> int:
    return Comment.objects.filter(post=post, approved=True).count()


def stored(post: Post) -> int:
    row = DeclStamped.objects.filter(post=post).values_list("comments", flat=True).first()
    return row or 0


def comments(post: Post, n: int) -> None:
    for _ in range(n):
        Comment.objects.create(post=post, approved=True)


def assert_exact(post: Post, expected: int) -> None:
    assert (truth(post), counters.get_value(NAME, post.pk)) == (expected, expected)
    result = counters.flush()
    assert result.quarantined == 0
    assert (truth(post), counters.get_value(NAME, post.pk), stored(post)) == (
        expected,
        expected,
        expected,
    )


def test_the_flush_creates_stamped_rows_with_the_current_time(applier):
    post, other = Post.objects.create(), Post.objects.create()
    before = timezone.now()
    comments(post, 3)
    comments(other, 1)
    assert_exact(post, 3)
    assert_exact(other, 1)
    row = DeclStamped.objects.get(post=post)
    after = timezone.now()
    assert before <= row.created <= after
    assert before <= row.updated <= after
    assert row.day in {before.date(), timezone.localdate(), after.date(), datetime.date.today()}


def test_auto_now_moves_on_with_each_flush_and_auto_now_add_stays(applier):
    post = Post.objects.create()
    comments(post, 2)
    assert_exact(post, 2)
    first = DeclStamped.objects.get(post=post)
    comments(post, 1)
    Comment.objects.filter(post=post).first().delete()
    assert_exact(post, 2)  # +1 -1: nothing to add, the row is not touched
    comments(post, 2)
    assert_exact(post, 4)
    second = DeclStamped.objects.get(post=post)
    assert second.created == first.created
    assert second.updated > first.updated
