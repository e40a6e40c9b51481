"""Ground truth of the related-key counters, computed with SQL over the join.

Each function takes the table of counters it reads (``table``, :data:`COUNTERS`
by default); ``tests.blog.hops`` passes its own.
"""

from __future__ import annotations

from django.db.models import Count, Q, Sum

import counters
from tests.blog.models import RelAuthor, RelAuthorStats, RelComment, RelPost, RelPostStats

#: counter -> (source, key lookup, where, aggregate, counter model, counter column, key model).
Table = dict[str, tuple]

COUNTERS: Table = {
    "author_comments": (
        RelComment,
        "post__author",
        Q(approved=True),
        Count("pk"),
        RelAuthorStats,
        "comments",
        RelAuthor,
    ),
    "editor_points": (
        RelComment,
        "post__editor",
        Q(approved=True, post__published=True),
        Sum("points"),
        RelAuthorStats,
        "points",
        RelAuthor,
    ),
    "thread_author_comments": (
        RelComment,
        "thread__author",
        Q(approved=True),
        Count("pk"),
        RelAuthorStats,
        "thread_comments",
        RelAuthor,
    ),
    "post_published_comments": (
        RelComment,
        "post",
        Q(approved=True, post__published=True),
        Count("pk"),
        RelPostStats,
        "published_comments",
        RelPost,
    ),
}


def truths(name: str, using: str = "default", table: Table = COUNTERS) -> dict[int, int]:
    """{key: truth} of every key with a non-zero truth (one SQL query over the joins)."""
    source, key, where, total, *_ = table[name]
    rows = source.objects.using(using).filter(where).filter(**{f"{key}__isnull": False})
    grouped = rows.order_by().values(key).annotate(n=total).values_list(key, "n")
    return {k: int(n or 0) for k, n in grouped if n}


def stored(name: str, using: str = "default", table: Table = COUNTERS) -> dict[int, int]:
    *_, model, column, _key_model = table[name]
    rows = model.objects.using(using).values_list("pk", column)
    return {pk: n for pk, n in rows if n}


def keys(name: str, using: str = "default", table: Table = COUNTERS) -> list[int]:
    key_model = table[name][-1]
    return list(key_model.objects.using(using).values_list("pk", flat=True))


def wrong(name: str, using: str = "default", table: Table = COUNTERS) -> dict[int, tuple[int, int]]:
    """{key: (get_value, truth)} where they differ, for every row of the key model."""
    truth = truths(name, using, table)
    found = {}
    for key in keys(name, using, table):
        value = counters.get_value(name, key, using=using)
        if value != truth.get(key, 0):
            found[key] = (value, truth.get(key, 0))
    return found


def assert_related_exact(
    flush: bool = True, using: str = "default", table: Table = COUNTERS
) -> None:
    """get_value equals the SQL truth for every key; after a flush the stored rows do too."""
    for name in table:
        assert wrong(name, using, table) == {}, name
    if not flush:
        return
    counters.flush(using=using)
    for name in table:
        existing = set(keys(name, using, table))
        kept = {k: n for k, n in stored(name, using, table).items() if k in existing}
        assert kept == truths(name, using, table), name
        assert wrong(name, using, table) == {}, name
