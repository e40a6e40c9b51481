"""A delete counts the same whatever order Django's collector deletes and nulls rows in.

With a nullable foreign key Django does not order the deletes (PostgreSQL deletes a post
before its notes), and on MySQL/MariaDB it first sets such a key to NULL, then deletes
the rows. A note's related key (``post__author``, ``post__blog__owner``) and condition
(``post__isnull=False``) are read for every row the collector will delete or update once,
before any of its statements, and each row counts once: ``get_value`` before the flush
and the stored rows after it equal the SQL truth.
"""

from __future__ import annotations

import pytest
from django.db.models import Q

import counters
from tests.deletes.cells import declare, sql_counts, stored, values
from tests.deletes.models import Blog, Note, Person, PersonStats, Post

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

__all__ = ["declare"]

NOTE = "deletes_note"


def _truth(column: str) -> dict[int, int]:
    if column == "writer":
        return sql_counts(
            f"SELECT writer_id, COUNT(*) FROM {NOTE} WHERE post_id IS NOT NULL GROUP BY writer_id"
        )
    join = {
        "author": "JOIN deletes_post p ON p.id = n.post_id",
        "owner": "JOIN deletes_post p ON p.id = n.post_id JOIN deletes_blog b ON b.id = p.blog_id",
    }[column]
    key = "p.author_id" if column == "author" else "b.owner_id"
    return sql_counts(f"SELECT {key}, COUNT(*) FROM {NOTE} n {join} GROUP BY {key}")


def _exact(name: str, column: str, people: list[Person], field: str = "n") -> None:
    keys = [p.pk for p in people]
    truth = {k: v for k, v in _truth(column).items() if k in keys}
    assert values(name, keys) == truth
    counters.flush()
    assert stored(PersonStats, "person_id", field) == truth
    assert values(name, keys) == truth


@pytest.fixture
def world():
    people = [Person.objects.create(code=c) for c in "abc"]
    anchor = Post.objects.create(author=people[2], anchor=True)
    blogs = [Blog.objects.create(owner=people[0]), Blog.objects.create(owner=people[1])]
    posts = [
        Post.objects.create(author=people[0], blog=blogs[0]),
        Post.objects.create(author=people[0], blog=blogs[1]),
        Post.objects.create(author=people[1], blog=blogs[0]),
    ]
    for post, n in zip(posts, (2, 3, 4), strict=True):
        for i in range(n):
            Note.objects.create(post=post, hard=anchor, writer=people[i % 2])
    return people, blogs, posts


def test_a_nullable_cascade_under_a_related_key(declare, world):
    people, _blogs, posts = world
    declare("notes_by_author", Note, key="post__author", into="deletes.PersonStats.n")
    declare("notes_by_owner", Note, key="post__blog__owner", into="deletes.PersonStats.m")
    counters.rebuild("notes_by_author")
    counters.rebuild("notes_by_owner")
    posts[0].delete()  # 2 of the author's 5 notes
    _exact("notes_by_author", "author", people)
    _exact("notes_by_owner", "owner", people, "m")
    Blog.objects.get(owner=people[0]).delete()  # the blog of post 2 and its 4 notes
    _exact("notes_by_author", "author", people)
    _exact("notes_by_owner", "owner", people, "m")


def test_a_nullable_cascade_under_an_own_column_condition(declare, world):
    people, blogs, posts = world
    declare(
        "notes_posted",
        Note,
        key="writer",
        into="deletes.PersonStats.n",
        where=Q(post__isnull=False),
    )
    counters.rebuild("notes_posted")
    posts[1].delete()
    _exact("notes_posted", "writer", people)
    Post.objects.filter(pk=posts[2].pk).delete()
    _exact("notes_posted", "writer", people)
    blogs[1].delete()
    _exact("notes_posted", "writer", people)
