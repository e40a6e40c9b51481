"""A row changed once counts once, whatever the joins of the queryset that changed it.

A filter through a multi-valued relation (a user's groups, a group's users)
joins one row per related row: the counted paths must count each changed
notification once, not once per joined row.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.auth.models import Group

from notifications.models import Notification, NotificationQuerySet
from tests.helpers import assert_exact, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.fixture
def grouped(make_user):
    """alice is in two groups (one with bob too) and has 4 unread; bob has 2 unread."""
    alice, bob = make_user("alice"), make_user("bob")
    staff, admins = Group.objects.create(name="staff"), Group.objects.create(name="admins")
    alice.groups.add(staff, admins)
    bob.groups.add(staff)
    for user, count in ((alice, 4), (bob, 2)):
        for i in range(count):
            Notification.objects.create(recipient=user, verb=f"n{i}")
    return alice, bob


TWO_WAY = ["staff", "admins"]

QUERIES: dict[str, Callable[[], NotificationQuerySet]] = {
    # alice's n0 joins her 2 groups
    "2-way": lambda: Notification.objects.filter(
        recipient__groups__name__in=TWO_WAY, verb="n0", recipient__username="alice"
    ),
    # alice's n0 joins 2 groups x 3 (group, member) pairs of those groups' members
    "3-way": lambda: Notification.objects.filter(
        recipient__groups__user__groups__name__in=TWO_WAY, verb="n0", recipient__username="alice"
    ),
    # every n0 and n1, each joined once per group of its recipient
    "many-rows": lambda: Notification.objects.filter(
        recipient__groups__name__in=TWO_WAY, verb__in=["n0", "n1"]
    ),
}


def rows_of(query: Callable[[], NotificationQuerySet]) -> set[int]:
    return set(query().values_list("pk", flat=True))


def joined_rows(query: Callable[[], NotificationQuerySet]) -> int:
    """How many rows the joined SELECT returns (more than distinct notifications)."""
    return len(query().values_list("pk", flat=True))


@pytest.mark.parametrize("name", list(QUERIES), ids=list(QUERIES))
def test_mark_all_read_through_a_join_counts_each_row_once(grouped, name):
    alice, bob = grouped
    query = QUERIES[name]
    rows = rows_of(query)
    assert joined_rows(query) > len(rows)  # the join does repeat rows
    assert query().mark_all_read() == len(rows)
    assert truth(alice) + truth(bob) == 6 - len(rows)
    assert_exact(alice, bob)


@pytest.mark.parametrize("name", list(QUERIES), ids=list(QUERIES))
def test_update_through_a_join_counts_each_row_once(grouped, name):
    alice, bob = grouped
    query = QUERIES[name]
    rows = rows_of(query)
    assert query().update(is_read=True) == len(rows)
    assert Notification.objects.filter(is_read=True).count() == len(rows)
    assert_exact(alice, bob)
    assert query().update(recipient=bob, is_read=False) == len(rows)
    assert Notification.objects.filter(recipient=bob).count() >= len(rows)
    assert_exact(alice, bob)


@pytest.mark.parametrize("name", list(QUERIES), ids=list(QUERIES))
def test_delete_through_a_join_counts_each_row_once(grouped, name):
    alice, bob = grouped
    query = QUERIES[name]
    rows = rows_of(query)
    before = truth(alice) + truth(bob)
    assert query().delete() == (len(rows), {"notifications.Notification": len(rows)})
    assert truth(alice) + truth(bob) == before - len(rows)
    assert_exact(alice, bob)


def test_mark_read_of_one_row_through_a_join(grouped):
    """The case of the report: one of alice's 4 unread, found through her 2 groups."""
    alice, _ = grouped
    assert QUERIES["2-way"]().mark_all_read() == 1
    assert truth(alice) == 3
    assert_exact(alice)
    assert QUERIES["2-way"]().mark_all_unread() == 1
    assert truth(alice) == 4
    assert_exact(alice)
