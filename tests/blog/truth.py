"""Ground truth of the blog's counters, computed with SQL, and the exactness assertion."""

from __future__ import annotations

from django.db.models import Sum

import counters
from tests.blog.models import Comment, Post, PostStats

COUNTERS = ("post_comments", "post_points")


def truth(name: str, post: Post | int, using: str = "default") -> int:
    """COUNT(*) (post_comments) or SUM(points) (post_points) of the post's approved comments."""
    pk = getattr(post, "pk", post)
    rows = Comment.objects.using(using).filter(post_id=pk, approved=True)
    if name == "post_comments":
        return rows.count()
    return rows.aggregate(total=Sum("points"))["total"] or 0


def stored(name: str, post: Post | int, using: str = "default") -> int:
    pk = getattr(post, "pk", post)
    column = {"post_comments": "comments", "post_points": "points"}[name]
    row = PostStats.objects.using(using).filter(pk=pk).values_list(column, flat=True).first()
    return row or 0


def figures(posts, using: str = "default") -> dict:
    """{(counter, post pk): (get_value, truth)} of every counter of ``posts``."""
    return {
        (name, post.pk): (
            counters.get_value(name, post.pk, using=using),
            truth(name, post, using),
        )
        for name in COUNTERS
        for post in posts
    }


def assert_exact(*posts, flush: bool = True, using: str = "default") -> None:
    """get_value equals the truth now; after a flush the stored rows equal it too."""
    now = figures(posts, using)
    assert {k: v for k, v in now.items() if v[0] != v[1]} == {}, now
    if flush:
        counters.flush(using=using)
        rows = {
            (name, post.pk): (stored(name, post, using), truth(name, post, using))
            for name in COUNTERS
            for post in posts
        }
        assert {k: v for k, v in rows.items() if v[0] != v[1]} == {}, rows
        after = figures(posts, using)
        assert {k: v for k, v in after.items() if v[0] != v[1]} == {}, after
