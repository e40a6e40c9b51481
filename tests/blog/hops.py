"""Ground truth of the counters over paths of several relations, computed with SQL joins."""

from __future__ import annotations

from django.db.models import Count, Q, Sum

import counters
from tests.blog.models import HopBlog, HopBlogStats, HopComment, HopOwner, HopOwnerStats, HopPost

#: counter -> (source, key lookup, where, aggregate, counter model, counter column, key model).
COUNTERS = {
    "hop_owner_comments": (
        HopComment,
        "post__blog__owner",
        Q(approved=True, post__published=True),
        Count("pk"),
        HopOwnerStats,
        "comments",
        HopOwner,
    ),
    "hop_founder_points": (
        HopComment,
        "post__blog__founder",
        Q(approved=True, post__blog__public=True),
        Sum("points"),
        HopOwnerStats,
        "points",
        HopOwner,
    ),
    "hop_blog_comments": (
        HopComment,
        "post__blog",
        Q(post__published=True),
        Count("pk"),
        HopBlogStats,
        "comments",
        HopBlog,
    ),
    "hop_active_comments": (
        HopComment,
        "post__blog__owner",
        Q(post__blog__owner__active=True),
        Count("pk"),
        HopOwnerStats,
        "active_comments",
        HopOwner,
    ),
    "hop_owner_posts": (
        HopPost,
        "blog__owner",
        Q(published=True),
        Count("pk"),
        HopOwnerStats,
        "posts",
        HopOwner,
    ),
}


def truths(name: str, using: str = "default") -> dict[int, int]:
    """{key: truth} of every key with a non-zero truth (one SQL query over the joins)."""
    source, key, where, total, *_ = COUNTERS[name]
    rows = source.objects.using(using).filter(where).filter(**{f"{key}__isnull": False})
    grouped = rows.order_by().values(key).annotate(n=total).values_list(key, "n")
    return {k: int(n or 0) for k, n in grouped if n}


def stored(name: str, using: str = "default") -> dict[int, int]:
    *_, model, column, _key_model = COUNTERS[name]
    rows = model.objects.using(using).values_list("pk", column)
    return {pk: n for pk, n in rows if n}


def keys(name: str, using: str = "default") -> list[int]:
    key_model = COUNTERS[name][6]
    return list(key_model.objects.using(using).values_list("pk", flat=True))


def wrong(name: str, using: str = "default") -> dict[int, tuple[int, int]]:
    """{key: (get_value, truth)} where they differ, for every row of the key model."""
    truth = truths(name, using)
    found = {}
    for key in keys(name, using):
        value = counters.get_value(name, key, using=using)
        if value != truth.get(key, 0):
            found[key] = (value, truth.get(key, 0))
    return found


def assert_hops_exact(flush: bool = True, using: str = "default") -> None:
    """get_value equals the SQL truth for every key; after a flush the stored rows do too."""
    for name in COUNTERS:
        assert wrong(name, using) == {}, name
    if not flush:
        return
    counters.flush(using=using)
    for name in COUNTERS:
        existing = set(keys(name, using))
        kept = {k: n for k, n in stored(name, using).items() if k in existing}
        assert kept == truths(name, using), name
        assert wrong(name, using) == {}, name
