"""An insert counted by its model's insert plan: one statement, exact, whatever the values.

A model none of whose trackers reads related rows counts a plain insert
from the instance's own values (:class:`counters.tracking.trackers.InsertPlan`):
no lock, no read, no transaction of its own. A value that is not of its
field's own type is converted as every other path converts it, and an
expression is read back inside a transaction, as before.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.models import Value
from django.test.utils import CaptureQueriesContext

import counters
from counters.tracking import trackers
from counters.tracking.trackers import insert_plan
from notifications.models import Notification
from tests.blog.models import Comment, Post, PostStats, RelComment
from tests.helpers import assert_exact, in_redis, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_plain_insert_is_one_statement_and_counted_once(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")  # the buffer's layout recorded once
    with CaptureQueriesContext(connection) as queries:
        Notification.objects.create(recipient=alice, verb="v")
    assert [q["sql"].split()[0] for q in queries] == ["INSERT"]
    assert in_redis(alice) == truth(alice) == 2
    assert_exact(alice)


@pytest.mark.parametrize(
    ("recipient", "is_read", "counted"),
    [
        pytest.param(str, 0, 1, id="key-as-text-flag-as-int"),
        pytest.param(str, 1, 0, id="read-as-int"),
        pytest.param(int, False, 1, id="native"),
    ],
)
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_values_not_of_their_fields_type_are_converted(make_user, recipient, is_read, counted):
    alice = make_user()
    Notification.objects.create(recipient_id=recipient(alice.pk), verb="v", is_read=is_read)
    assert in_redis(alice) == truth(alice) == counted
    assert_exact(alice)


@pytest.mark.parametrize(("is_read", "counted"), [(False, 1), (True, 0)])
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_an_expression_is_read_back_in_a_transaction(make_user, is_read, counted):
    alice = make_user()
    with CaptureQueriesContext(connection) as queries:
        Notification.objects.create(recipient=alice, verb="v", is_read=Value(is_read))
    assert in_redis(alice) == truth(alice) == counted
    # the stored value read back: by a SELECT of the row, or (Django 6.0 on a backend that
    # can) by the INSERT's RETURNING clause
    table = Notification._meta.db_table
    sql = [q["sql"] for q in queries if table in q["sql"]]
    insert = [s for s in sql if s.startswith("INSERT")]
    selected = [s for s in sql if s.startswith("SELECT")]
    returned = [s for s in insert if '"is_read"' in s.partition("RETURNING")[2]]
    assert len(insert) == 1 and (selected or returned), sql
    assert_exact(alice)


def test_two_counters_of_one_model_share_the_plan():
    post = Post.objects.create(title="p")
    for approved, points in ((True, 3), (True, 0), (False, 5), (True, 2)):
        Comment.objects.create(post=post, approved=approved, points=points)
    counters.flush()
    stats = PostStats.objects.get(pk=post.pk)
    approved = Comment.objects.filter(post=post, approved=True)
    assert stats.comments == approved.count() == 3
    assert stats.points == sum(approved.values_list("points", flat=True)) == 5


def test_a_model_with_a_related_tracker_has_no_plan():
    assert insert_plan(RelComment) is None
    assert insert_plan(Notification) is not None


def test_the_plan_follows_the_trackers_of_its_model(monkeypatch):
    monkeypatch.setattr(trackers, "_by_model", dict(trackers._by_model))
    before = insert_plan(Comment)
    assert before is not None and insert_plan(Comment) is before  # kept
    assert [t.name for t in before.trackers] == ["post_comments", "post_points"]
    assert before.attnames == ("post_id", "approved", "points")
    trackers._by_model[Comment] = before.trackers[:1]  # as a test's own trackers come and go
    after = insert_plan(Comment)
    assert after is not None and after is not before
    assert [t.name for t in after.trackers] == ["post_comments"]
    monkeypatch.undo()
    assert insert_plan(Comment).trackers == before.trackers


ROWS = {
    Notification: [
        {"recipient_id": 7, "is_read": False},
        {"recipient_id": 7, "is_read": True},
        {"recipient_id": None, "is_read": False},
        {"recipient_id": 2**30, "is_read": False},
    ],
    Comment: [
        {"post_id": 3, "approved": True, "points": 4},
        {"post_id": 3, "approved": True, "points": 0},
        {"post_id": 3, "approved": False, "points": 5},
        {"post_id": None, "approved": True, "points": 2},
        {"post_id": 9, "approved": True, "points": -6},
    ],
}


@pytest.mark.parametrize("model", [Notification, Comment])
def test_the_plans_members_are_what_each_tracker_adds_for_a_new_row(model):
    """:meth:`InsertPlan.members` reads each tracker's key, condition and amount as
    :meth:`Tracker.add_members` does: the same members and deltas for every row."""
    plan = insert_plan(model)
    assert plan is not None
    counted = 0
    for row in ROWS[model]:
        expected: dict[str, int] = {}
        for tracker in plan.trackers:
            tracker.add_members(expected, (), (row,))
        expected = {member: delta for member, delta in expected.items() if delta}
        assert plan.members(row) == expected, row
        counted += bool(expected)
    assert counted == {Notification: 2, Comment: 3}[model]


def test_a_value_not_of_its_fields_own_type_leaves_the_row_to_be_converted():
    """:meth:`InsertPlan.members` counts from the values only when each is of its field's
    own type (or None); any other value, or one missing, makes it None."""
    plan = insert_plan(Notification)
    assert plan is not None
    assert plan.members({"recipient_id": 7, "is_read": False}) == {"unread:7": 1}
    assert plan.members({"recipient_id": None, "is_read": False}) == {}
    assert plan.members({"recipient_id": "7", "is_read": False}) is None  # text for a key
    assert plan.members({"recipient_id": True, "is_read": False}) is None  # a bool for an int
    assert plan.members({"recipient_id": 7, "is_read": 0}) is None  # an int for a bool
    assert plan.members({"is_read": False}) is None  # deferred: not loaded


def test_an_expression_among_the_tracked_values_is_found():
    plan = insert_plan(Notification)
    assert plan is not None
    assert not plan.has_expression({"recipient_id": 7, "is_read": False})
    assert not plan.has_expression({"recipient_id": None})  # deferred: no expression
    assert plan.has_expression({"recipient_id": 7, "is_read": Value(True)})
    assert not plan.has_expression({"recipient_id": 7, "is_read": False, "verb": Value("x")})
