"""A key that is not exactly a value of its field is refused, by add() and reads alike.

``2.7`` used to be read and written as key 2 (``int()`` truncates): a
counter other than the one meant. Text and ints are still converted
(``"7"`` is 7), and a number equal to a value of the field (``2.0``) is
that value.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import transaction

import counters
from counters import registry
from counters.exceptions import InvalidKey
from tests.blog.models import Comment, Post, PostStats

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

NAME = "post_comments"


def truth(post: Post) -> int:
    return Comment.objects.filter(post=post, approved=True).count()


def stored(post: Post) -> int:
    row = PostStats.objects.filter(post=post).values_list("comments", flat=True).first()
    return row or 0


@pytest.fixture
def post() -> Post:
    """A post with pk 2 and two approved comments, flushed; then one more, buffered."""
    Post.objects.create(pk=1)
    post = Post.objects.create(pk=2)
    for _ in range(2):
        Comment.objects.create(post=post, approved=True)
    counters.flush()
    Comment.objects.create(post=post, approved=True)
    return post


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(2.7, id="float"),
        pytest.param(1.5, id="float-half"),
        pytest.param(Decimal("2.5"), id="decimal"),
        pytest.param(float("inf"), id="infinity"),
        pytest.param(float("nan"), id="nan"),
    ],
)
def test_an_inexact_key_is_refused_by_add_and_reads(post, key):
    with pytest.raises(InvalidKey) as info:
        counters.get_value(NAME, key)
    assert (info.value.counter, info.value.key) == (NAME, key)
    with pytest.raises(InvalidKey):
        counters.get_values(NAME, [post.pk, key])
    with transaction.atomic():
        with pytest.raises(InvalidKey):
            counters.add(NAME, key, 5)
        with pytest.raises(InvalidKey):
            counters.add_many(NAME, {post.pk: 1, key: 5})  # nothing of the call is recorded
    assert (truth(post), counters.get_value(NAME, post.pk)) == (3, 3)
    counters.flush()
    assert (truth(post), counters.get_value(NAME, post.pk), stored(post)) == (3, 3, 3)
    assert stored(Post(pk=1)) == 0


def test_the_float_key_2_7_no_longer_reads_key_2(post):
    with pytest.raises(InvalidKey, match=r"not exactly a value of the key field \(it would be 2\)"):
        counters.get_value(NAME, 2.7)


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(2, id="int"),
        pytest.param("2", id="str"),
        pytest.param(2.0, id="whole-float"),
        pytest.param(Decimal("2"), id="whole-decimal"),
    ],
)
def test_an_exact_key_reads_and_adds_its_counter(post, key):
    assert counters.get_value(NAME, key) == 3
    assert registry.get_spec(NAME).member(key) == f"{NAME}:2"
