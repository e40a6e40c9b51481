"""Related conditions (``where=Q(post__published=True)``), a seeded random mix of every path,
and writers racing on the middle rows: all exact against the SQL truth over the join.
"""

from __future__ import annotations

import random

import pytest
from django.db import transaction
from django.db.models import Q

import counters
from counters.tracking.where import WhereError, compile_where
from tests.blog.models import RelAuthor, RelComment, RelPost
from tests.blog.related import assert_related_exact, truths
from tests.conftest import has_row_locks
from tests.helpers import race

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def test_a_related_where_is_decided_from_the_row_and_its_path_values():
    hops: dict = {}
    test, attnames = compile_where(
        RelComment, Q(approved=True) & ~Q(post__published=False), hops=hops
    )
    assert attnames == {"approved"} and list(hops) == ["post__published"]
    assert test({"approved": True, "post__published": True})
    assert not test({"approved": True, "post__published": False})
    with pytest.raises(WhereError, match="follows a relation"):
        compile_where(RelComment, Q(post__published=True))  # not accepted without hops


def test_publishing_moves_every_comment_at_once():
    a = RelAuthor.objects.create(name="a")
    post = RelPost.objects.create(author=a, editor=a)
    RelComment.objects.bulk_create([RelComment(post=post, approved=True, points=3)] * 5)
    assert counters.get_value("post_published_comments", post.pk) == 0
    post.published = True
    post.save()
    assert counters.get_value("post_published_comments", post.pk) == 5
    assert counters.get_value("editor_points", a.pk) == 15
    RelPost.objects.filter(pk=post.pk).update(published=False)
    assert counters.get_value("post_published_comments", post.pk) == 0
    RelPost.objects.filter(pk=post.pk).update(published=True)
    post.refresh_from_db()
    post.save(update_fields=["published"])  # unchanged: nothing moves
    assert_related_exact()
    assert truths("post_published_comments") == {post.pk: 5}


def step(rng: random.Random, authors: list[RelAuthor]) -> None:
    """One random change, through one of the paths of comments, posts and authors."""
    posts = list(RelPost.objects.order_by("pk"))
    choice = rng.randrange(12)
    if not posts or choice == 0:
        RelPost.objects.create(
            author=rng.choice(authors),
            editor=rng.choice([*authors, None]),
            published=rng.random() < 0.5,
        )
        return
    post = rng.choice(posts)
    comments = list(RelComment.objects.filter(post__in=posts).order_by("pk"))
    if choice == 1 or not comments:
        RelComment.objects.create(post=post, approved=rng.random() < 0.7, points=rng.randrange(5))
    elif choice == 2:
        RelComment.objects.bulk_create(
            [RelComment(post=rng.choice(posts), approved=True) for _ in range(3)]
        )
    elif choice == 3:
        comment = rng.choice(comments)
        comment.approved = not comment.approved
        comment.save()
    elif choice == 4:
        RelComment.objects.filter(pk=rng.choice(comments).pk).update(post=post)
    elif choice == 5:
        post.author = rng.choice(authors)
        post.editor = rng.choice([*authors, None])
        post.save()
    elif choice == 6:
        RelPost.objects.filter(author=rng.choice(authors)).update(author=rng.choice(authors))
    elif choice == 7:
        RelPost.objects.filter(pk__in=[p.pk for p in posts[::2]]).update(
            published=rng.random() < 0.5
        )
    elif choice == 8:
        post.published = not post.published
        post.save(update_fields=["published"])
    elif choice == 9:
        rng.choice(comments).delete()
    elif choice == 10:
        post.delete()
    else:
        victim = rng.choice(authors)
        victim.delete()  # CASCADE on its posts, SET_NULL as an editor
        authors.remove(victim)
        authors.append(RelAuthor.objects.create(name=f"n{rng.randrange(10**6)}"))


@pytest.mark.parametrize("seed", [1, 2])
def test_a_random_mix_of_every_path_stays_exact(seed):
    rng = random.Random(seed)
    authors = [RelAuthor.objects.create(name=f"a{i}") for i in range(4)]
    for batch in range(8):
        for _ in range(12):
            if rng.random() < 0.25:
                with transaction.atomic():
                    step(rng, authors)
                    step(rng, authors)
            else:
                step(rng, authors)
        assert_related_exact(flush=batch % 2 == 1)
    assert_related_exact()


THREADS = 16
ROUNDS = 12


@pytest.mark.serial
@pytest.mark.postgres
@pytest.mark.skipif(not has_row_locks(), reason="needs row locks between connections")
def test_racing_post_moves_and_new_comments_end_exact():
    authors = [RelAuthor.objects.create(name=f"r{i}") for i in range(4)]
    posts = [
        RelPost.objects.create(author=authors[i % 4], editor=authors[(i + 1) % 4], published=True)
        for i in range(3)
    ]
    pks = [p.pk for p in posts]

    def write(i: int, barrier) -> None:
        rng = random.Random(i)
        for round_ in range(ROUNDS):
            barrier.wait(timeout=60)
            _race_step(i, round_, pks[(i + round_) % len(pks)], rng, authors)

    race(THREADS, write, timeout=300)
    assert_related_exact()
    assert (
        sum(truths("author_comments").values()) == RelComment.objects.filter(approved=True).count()
    )


def _race_step(i: int, round_: int, pk: int, rng: random.Random, authors: list) -> None:
    route = (i + round_) % 5
    if route == 0:
        post = RelPost.objects.get(pk=pk)
        post.author = rng.choice(authors)
        post.published = rng.random() < 0.7
        post.save()
    elif route == 1:
        RelPost.objects.filter(pk=pk).update(author=rng.choice(authors), editor=rng.choice(authors))
    elif route == 2:
        RelComment.objects.create(post_id=pk, approved=rng.random() < 0.8, points=rng.randrange(4))
    elif route == 3:
        with transaction.atomic():
            comment = RelComment.objects.create(post_id=pk, approved=False)
            RelComment.objects.filter(pk=comment.pk).update(approved=True, points=2)
    else:  # an existing comment: no foreign key check locks its post
        first = list(RelComment.objects.filter(post_id=pk).order_by("pk").values_list("pk")[:3])
        RelComment.objects.filter(pk__in=[row[0] for row in first]).update(
            approved=rng.random() < 0.5
        )
