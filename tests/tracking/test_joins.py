"""A row changed once counts once, whatever the joins of the queryset that changed it.

A filter through a multi-valued relation (a user's groups, a group's users)
joins one row per related row: the counted paths must count each changed
notification once, not once per joined row. A join may also be nullable: on
PostgreSQL ``SELECT ... FOR UPDATE`` refuses the nullable side of an outer
join, so the counted paths lock only the notification rows (``OF self``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import DatabaseError, connection, connections, transaction
from django.db.models import Q

from notifications.models import Notification, NotificationQuerySet
from tests.helpers import assert_exact, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


# -- through a multi-valued relation (a user's groups) ---------------------------------


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

GROUP_JOINS: dict[str, Callable[[], NotificationQuerySet]] = {
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


@pytest.mark.parametrize("name", list(GROUP_JOINS), ids=list(GROUP_JOINS))
def test_mark_all_read_through_a_join_counts_each_row_once(grouped, name):
    alice, bob = grouped
    query = GROUP_JOINS[name]
    rows = rows_of(query)
    assert joined_rows(query) > len(rows)  # the join does repeat rows
    assert query().mark_all_read() == len(rows)
    assert truth(alice) + truth(bob) == 6 - len(rows)
    assert_exact(alice, bob)


@pytest.mark.parametrize("name", list(GROUP_JOINS), ids=list(GROUP_JOINS))
def test_update_through_a_join_counts_each_row_once(grouped, name):
    alice, bob = grouped
    query = GROUP_JOINS[name]
    rows = rows_of(query)
    assert query().update(is_read=True) == len(rows)
    assert Notification.objects.filter(is_read=True).count() == len(rows)
    assert_exact(alice, bob)
    assert query().update(recipient=bob, is_read=False) == len(rows)
    assert Notification.objects.filter(recipient=bob).count() >= len(rows)
    assert_exact(alice, bob)


@pytest.mark.parametrize("name", list(GROUP_JOINS), ids=list(GROUP_JOINS))
def test_delete_through_a_join_counts_each_row_once(grouped, name):
    alice, bob = grouped
    query = GROUP_JOINS[name]
    rows = rows_of(query)
    before = truth(alice) + truth(bob)
    assert query().delete() == (len(rows), {"notifications.Notification": len(rows)})
    assert truth(alice) + truth(bob) == before - len(rows)
    assert_exact(alice, bob)


def test_mark_read_of_one_row_through_a_join(grouped):
    """The case of the report: one of alice's 4 unread, found through her 2 groups."""
    alice, _ = grouped
    assert GROUP_JOINS["2-way"]().mark_all_read() == 1
    assert truth(alice) == 3
    assert_exact(alice)
    assert GROUP_JOINS["2-way"]().mark_all_unread() == 1
    assert truth(alice) == 4
    assert_exact(alice)


# -- through other tables, nullable ones included (the actor) --------------------------


@pytest.fixture
def people(make_user):
    """alice and bob receive; carol and dave act; some notifications have no actor."""
    alice, bob, carol, dave = (make_user(name) for name in ("alice", "bob", "carol", "dave"))
    rows = [
        (alice, carol, False),
        (alice, carol, False),
        (alice, carol, True),
        (alice, dave, False),
        (alice, None, False),
        (alice, None, True),
        (bob, carol, False),
        (bob, dave, False),
        (bob, None, False),
    ]
    for recipient, actor, is_read in rows:
        Notification.objects.create(recipient=recipient, actor=actor, verb="v", is_read=is_read)
    return alice, bob


ACTOR_JOINS: dict[str, Callable[[], NotificationQuerySet]] = {
    "actor-username": lambda: Notification.objects.filter(actor__username="carol"),
    "no-actor-or-username": lambda: Notification.objects.filter(
        Q(actor__isnull=True) | Q(actor__username="dave")
    ),
    "select-related-actor": lambda: (
        Notification.objects.select_related("actor", "recipient")
        .filter(Q(actor__username="carol") | Q(verb="nothing"))
        .order_by("actor__username")
    ),
}


def expected_rows(query: Callable[[], NotificationQuerySet]) -> set[int]:
    """Primary keys the query matches, read without any lock."""
    return set(query().values_list("pk", flat=True))


@pytest.mark.parametrize("name", list(ACTOR_JOINS), ids=list(ACTOR_JOINS))
def test_mark_all_read_on_a_joined_queryset(people, name):
    alice, bob = people
    query = ACTOR_JOINS[name]
    unread = set(query().filter(is_read=False).values_list("pk", flat=True))
    assert query().mark_all_read() == len(unread) > 0
    assert not Notification.objects.filter(pk__in=unread, is_read=False).exists()
    assert_exact(alice, bob)


@pytest.mark.parametrize("name", list(ACTOR_JOINS), ids=list(ACTOR_JOINS))
def test_update_on_a_joined_queryset_moves_the_counts(people, name):
    alice, bob = people
    query = ACTOR_JOINS[name]
    rows = expected_rows(query)
    assert query().update(recipient=bob, is_read=False) == len(rows)
    assert set(Notification.objects.filter(recipient=bob).values_list("pk", flat=True)) >= rows
    assert_exact(alice, bob)
    assert query().mark_all_unread() == 0


@pytest.mark.parametrize("name", list(ACTOR_JOINS), ids=list(ACTOR_JOINS))
def test_delete_on_a_joined_queryset(people, name):
    alice, bob = people
    query = ACTOR_JOINS[name]
    rows = expected_rows(query)
    before = truth(alice) + truth(bob)
    unread = Notification.objects.filter(pk__in=rows, is_read=False).count()
    deleted, by_model = query().delete()
    assert (deleted, by_model) == (len(rows), {"notifications.Notification": len(rows)})
    assert not Notification.objects.filter(pk__in=rows).exists()
    assert truth(alice) + truth(bob) == before - unread
    assert_exact(alice, bob)


def lock_is_free(model, pk) -> bool:
    """Whether another connection can lock row ``pk`` of ``model`` at once (NOWAIT)."""
    free: list[bool] = []

    def probe() -> None:
        try:
            with transaction.atomic():
                list(model.objects.select_for_update(nowait=True).filter(pk=pk))
            free.append(True)
        except DatabaseError:
            free.append(False)
        finally:
            connections.close_all()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return free == [True]


ACTIONS: dict[str, Callable[[NotificationQuerySet], object]] = {
    "mark_all_read": lambda qs: qs.mark_all_read(),
    "update": lambda qs: qs.update(is_read=True),
    "delete": lambda qs: qs.delete(),
}


@pytest.mark.skipif(connection.vendor == "sqlite", reason="needs row locks")
@pytest.mark.parametrize("action", list(ACTIONS), ids=list(ACTIONS))
def test_counted_paths_lock_only_notification_rows(people, action):
    if not connection.features.has_select_for_update_of:
        pytest.skip("MariaDB has no SELECT … FOR UPDATE OF: the joined rows are locked too")
    alice, bob = people
    carol = get_user_model().objects.get(username="carol")
    with transaction.atomic():
        ACTIONS[action](Notification.objects.filter(actor__username="carol"))
        assert lock_is_free(get_user_model(), carol.pk)  # the joined actor row is not locked
    assert_exact(alice, bob)
