"""A ``where`` decided in Python gives the database's answer, NULLs and negation included."""

from __future__ import annotations

import itertools

import pytest
from django.db.models import Q

from counters.tracking.where import compile_where, python_value
from tests.blog.models import Comment, Post

pytestmark = pytest.mark.django_db


def instance_row(obj) -> dict:
    """Every field of ``obj`` as the field stores it."""
    return {f.attname: python_value(f, getattr(obj, f.attname)) for f in obj._meta.concrete_fields}


WHERES = [
    pytest.param(Q(approved=True), id="exact-bool"),
    pytest.param(Q(rating=None), id="exact-none"),
    pytest.param(Q(rating__isnull=False), id="isnull"),
    pytest.param(Q(rating__gt=1), id="gt-null"),
    pytest.param(~Q(rating__gt=1), id="not-gt-null"),
    pytest.param(~Q(rating=2), id="not-exact-null"),
    pytest.param(Q(rating__in=[1, None, 3]), id="in-with-none"),
    pytest.param(~Q(rating__in=[1, 3]), id="not-in"),
    pytest.param(Q(points__gte=0) & Q(points__lte=2), id="range"),
    pytest.param(Q(points__lt=0) | ~Q(approved=True), id="or-not"),
    pytest.param(Q(approved=True) ^ Q(rating__gte=2) ^ Q(points=1), id="xor"),
    pytest.param(~(Q(rating__lt=2) | Q(text="b")), id="not-of-or"),
    pytest.param(Q(text__in=["a", "B"]), id="text-in"),
    pytest.param(Q(post_id__in=[]), id="empty-in"),
    pytest.param(Q(), id="empty-q"),
]


@pytest.fixture(scope="module")
def rows(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        post = Post.objects.create(title="where")
        made = [
            Comment(post=post, approved=a, points=p, rating=r, text=t)
            for a, p, r, t in itertools.product(
                [True, False], [-1, 0, 1, 2], [None, 1, 2, 3], ["a", "b", "B"]
            )
        ]
        Comment.objects.bulk_create(made)
        yield post
        Comment.objects.filter(post=post).delete()
        post.delete()


@pytest.mark.parametrize("where", WHERES)
def test_python_decides_like_sql(rows, where):
    test, _ = compile_where(Comment, where)
    comments = Comment.objects.filter(post=rows)
    in_sql = set(comments.filter(where).values_list("pk", flat=True))
    read = {c.pk for c in comments if test(instance_row(c))}
    fields = ["pk", "approved", "points", "rating", "text", "post_id"]
    from_values = {v["pk"] for v in comments.values(*fields) if test(v)}
    assert in_sql == read == from_values
    assert 0 <= len(in_sql) <= comments.count()


def test_instance_values_are_read_as_the_field_stores_them(rows):
    test, _ = compile_where(Comment, Q(approved=True) & Q(points__gt=1))
    unsaved = Comment(post=rows, approved=1, points="2", rating=None)
    assert test(instance_row(unsaved)) is True
