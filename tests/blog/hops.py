"""Ground truth of the counters over paths of several relations, computed with SQL joins."""

from __future__ import annotations

from django.db.models import Count, Q, Sum

from tests.blog import related
from tests.blog.models import HopBlog, HopBlogStats, HopComment, HopOwner, HopOwnerStats, HopPost

#: The table of :mod:`tests.blog.related`: counter -> (source, key lookup, where, aggregate,
#: counter model, counter column, key model).
COUNTERS: related.Table = {
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
    return related.truths(name, using, COUNTERS)


def stored(name: str, using: str = "default") -> dict[int, int]:
    return related.stored(name, using, COUNTERS)


def assert_hops_exact(flush: bool = True, using: str = "default") -> None:
    """get_value equals the SQL truth for every key; after a flush the stored rows do too."""
    related.assert_related_exact(flush, using, COUNTERS)
