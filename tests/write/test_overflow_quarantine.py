"""A delta the database cannot apply (beyond its column's range) is quarantined, never dropped.

Deltas of 2**53 and beyond cannot be summed by a Redis score and are written
to the database directly. Twice 2**62 is beyond a bigint: that direct write
used to be logged and dropped. Now, as for a flush, the refused delta goes to
its shard's quarantine with its error, and the rest of the write is applied.
SQLite, which turns an overflowing integer into an inexact float, refuses it
as PostgreSQL does, on the flush path as well.
"""

from __future__ import annotations

import pytest
from django.db import transaction

import counters
from counters.client import get_buffer
from counters.models import FlushBatch
from tests.blog.models import Post, PostStats

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

NAME = "post_points"
BIGINT_MAX = 2**63 - 1


def stored(post: Post) -> int:
    row = PostStats.objects.filter(post=post).values_list("points", flat=True).first()
    return row or 0


def quarantined() -> dict[str, tuple[int, str]]:
    return {e.member: (e.delta, e.error) for e in get_buffer().quarantined()}


def add(deltas: dict[Post, int]) -> None:
    with transaction.atomic():
        counters.add_many(NAME, {post.pk: delta for post, delta in deltas.items()})


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_an_overflowing_direct_write_is_quarantined():
    post = Post.objects.create()
    add({post: 2**62})
    assert (stored(post), quarantined()) == (2**62, {})
    add({post: 2**62})
    assert stored(post) == 2**62
    assert type(stored(post)) is int
    [(member, (delta, error))] = quarantined().items()
    assert (member, delta) == (f"{NAME}:{post.pk}", 2**62)
    assert error.startswith("DataError: ")
    assert counters.get_value(NAME, post.pk) == 2**62
    counters.flush()
    assert stored(post) == 2**62
    assert len(quarantined()) == 1  # held until retried or discarded


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_the_rest_of_the_direct_write_is_applied():
    full, other = Post.objects.create(), Post.objects.create()
    add({full: 2**62})
    add({full: 2**62, other: 2**60})
    assert (stored(full), stored(other)) == (2**62, 2**60)
    assert {m: d for m, (d, _) in quarantined().items()} == {f"{NAME}:{full.pk}": 2**62}
    fallback = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).order_by("applied_at")
    assert [(b.keys, b.deltas) for b in fallback] == [(1, 2**62), (1, 2**60)]


def test_a_flush_quarantines_an_overflow_on_every_database():
    post, other = Post.objects.create(), Post.objects.create()
    add({post: 1, other: 1})
    counters.flush()
    PostStats.objects.filter(post=post).update(points=BIGINT_MAX - 5)
    add({post: 10, other: 2})
    result = counters.flush()
    assert result.quarantined == 1
    assert (stored(post), stored(other)) == (BIGINT_MAX - 5, 3)
    assert type(stored(post)) is int
    assert {m: d for m, (d, _) in quarantined().items()} == {f"{NAME}:{post.pk}": 10}
