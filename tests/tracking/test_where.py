"""A ``where`` decided in Python gives the database's answer, NULLs and negation included."""

from __future__ import annotations

import itertools

import pytest
from django.db import connection
from django.db.models import Q

from counters.tracking.where import WhereError, compile_where, python_value
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
    pytest.param(Q(approved=True) ^ Q(points__gte=1), id="xor-not-null"),
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


#: What MySQL and MariaDB answer otherwise than Python: refused there (see the test below).
NOT_ON_MYSQL = {"xor", "not-of-or", "text-in"}
MYSQL = connection.vendor == "mysql"


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(*p.values, id=p.id, marks=pytest.mark.skipif(MYSQL, reason="refused"))
        if p.id in NOT_ON_MYSQL
        else p
        for p in WHERES
    ],
)
def test_python_decides_like_sql(rows, where):
    test, _ = compile_where(Comment, where, mysql=MYSQL)
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


@pytest.mark.parametrize(
    ("where", "message"),
    [
        pytest.param(
            Q(approved=True) ^ Q(rating__gte=2),
            "where (XOR: ('approved', True), ('rating__gte', 2)): ^ over the nullable rating "
            "is NULL on MySQL and MariaDB when a value is NULL, which Python cannot follow "
            "(write it with &, | and ~)",
            id="xor-nullable",
        ),
        pytest.param(
            Q(text="b"),
            "where 'text': MySQL and MariaDB compare text by the column's collation ('a' = "
            "'A' = 'a ' by default), Python exactly: give the field a binary NO PAD "
            "db_collation (utf8mb4_0900_bin on MySQL, utf8mb4_nopad_bin on MariaDB)",
            id="text",
        ),
    ],
)
def test_mysql_refuses_what_python_cannot_decide_like_it(where, message):
    compile_where(Comment, where)  # elsewhere, decided in Python
    with pytest.raises(WhereError) as refused:
        compile_where(Comment, where, mysql=True)
    assert str(refused.value) == message
    compile_where(Comment, Q(approved=True) ^ Q(points=1) | Q(text__isnull=True), mysql=True)


def test_a_binary_no_pad_collation_is_compared_in_python_on_mysql(monkeypatch):
    field = Comment._meta.get_field("text")
    for collation in ("utf8mb4_nopad_bin", "utf8mb4_0900_bin", "binary"):
        monkeypatch.setattr(field, "db_collation", collation)
        test, _ = compile_where(Comment, Q(text="b"), mysql=True)
        assert [test({"text": t}) for t in ("b", "B", "b ")] == [True, False, False]
    monkeypatch.setattr(field, "db_collation", "utf8mb4_bin")  # PAD SPACE: 'b' = 'b '
    with pytest.raises(WhereError):
        compile_where(Comment, Q(text="b"), mysql=True)
