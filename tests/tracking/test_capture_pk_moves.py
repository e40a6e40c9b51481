"""Rows moved to a new primary key keep what they count.

``update(id=F("id") + 1000)`` moves each row: its key and contribution do not
change (unless the update changes them too), so it counts nothing by itself.
A save cannot move a row: a primary key given as an expression is refused
before anything is written.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from django.db import NotSupportedError
from django.db.models import F, IntegerField
from django.db.models.functions import Cast, Random

from notifications.models import Notification
from tests.blog.models import Comment, Post
from tests.blog.truth import assert_exact as assert_blog_exact
from tests.helpers import assert_exact, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.fixture
def inbox(make_user):
    """alice: 3 unread, 1 read; bob: 1 unread."""
    alice, bob = make_user("alice"), make_user("bob")
    for is_read in (False, False, False, True):
        Notification.objects.create(recipient=alice, verb="v", is_read=is_read)
    Notification.objects.create(recipient=bob, verb="v")
    return alice, bob


def pks_of(user) -> list[int]:
    return sorted(Notification.objects.filter(recipient=user).values_list("pk", flat=True))


@pytest.mark.parametrize(
    "also",
    [{}, {"is_read": F("is_read")}, {"recipient": F("recipient")}],
    ids=["alone", "is_read", "recipient"],
)
def test_update_moving_rows_by_an_expression_counts_nothing(inbox, also):
    alice, bob = inbox
    before = pks_of(alice)
    assert Notification.objects.filter(recipient=alice).update(id=F("id") + 1000, **also) == 4
    assert pks_of(alice) == [pk + 1000 for pk in before]
    assert (truth(alice), truth(bob)) == (3, 1)
    assert_exact(alice, bob)


def test_update_moving_and_changing_rows(inbox):
    alice, bob = inbox
    assert (
        Notification.objects.filter(recipient=alice).update(id=F("id") + 1000, recipient=bob) == 4
    )
    assert (truth(alice), truth(bob)) == (0, 4)
    assert_exact(alice, bob)
    moved = Notification.objects.filter(recipient=bob, is_read=False)
    assert moved.update(id=F("id") + 1000, is_read=F("is_read")) == 4
    assert Notification.objects.filter(recipient=bob).mark_all_read() == 4
    assert_exact(alice, bob)


def test_update_moving_rows_through_a_join(inbox):
    alice, bob = inbox
    staff = Group.objects.create(name="staff")
    alice.groups.add(staff, Group.objects.create(name="admins"))
    query = Notification.objects.filter(recipient__groups__name__in=["staff", "admins"])
    assert query.update(id=F("id") + 1000) == 4
    assert (truth(alice), truth(bob)) == (3, 1)
    assert_exact(alice, bob)


def test_update_moving_one_row_to_a_plain_key(inbox):
    alice, bob = inbox
    first = min(pks_of(alice))
    assert Notification.objects.filter(pk=first).update(id=99_999) == 1
    assert Notification.objects.filter(pk=99_999, recipient=alice).exists()
    assert (truth(alice), truth(bob)) == (3, 1)
    assert_exact(alice, bob)
    assert Notification.objects.filter(pk=99_999).update(id="88888", is_read=True) == 1
    assert (truth(alice), truth(bob)) == (2, 1)
    assert_exact(alice, bob)


def test_update_moving_rows_by_a_random_expression_is_refused(inbox):
    alice, bob = inbox
    before = pks_of(alice)
    query = Notification.objects.filter(recipient=alice)
    with pytest.raises(NotSupportedError, match="nothing was changed"):
        query.update(id=F("id") + Cast(Random() * 1_000_000, IntegerField()) + 1000, recipient=bob)
    assert pks_of(alice) == before
    assert (truth(alice), truth(bob)) == (3, 1)
    assert_exact(alice, bob)


def test_moving_amounts_of_a_tracked_sum():
    post = Post.objects.create(title="p")
    for points in (2, 3, 5):
        Comment.objects.create(post=post, approved=True, points=points)
    assert Comment.objects.filter(post=post).update(id=F("id") + 500, points=F("points") * 2) == 3
    assert_blog_exact(post)


def test_save_with_an_expression_as_primary_key_is_refused(inbox):
    alice, bob = inbox
    before = pks_of(alice)
    n = Notification.objects.get(pk=before[0])
    n.pk = F("id") + 1000
    n.is_read = True
    with pytest.raises(NotSupportedError, match="primary key is an expression"):
        n.save()
    assert pks_of(alice) == before
    assert (truth(alice), truth(bob)) == (3, 1)
    assert_exact(alice, bob)
