"""Buffered, exactly-once counters for Django.

Public API::

    import counters
    counters.track("post_comments", Comment, key="post",       # count rows of any model
                   into="blog.PostStats.comments", where=Q(approved=True))
    counters.get_value("post_comments", post.pk)                # stored + buffered, exact
    counters.flush()                                            # drain Redis into the rows
    with counters.paused(): ...                                 # a data migration, uncounted

    counters.register("unread", "notifications.UnreadCounter", key_field="user")
    counters.add("unread", user_id, +1)                         # by hand, sent after COMMIT
"""

from .client import get_buffer, get_client
from .context import paused
from .flushing import flush
from .queryset import CountedManager, CountedQuerySet
from .reads import get_parts, get_value, get_values
from .registry import register
from .tracking import track
from .writes import add, add_many

__all__ = [
    "CountedManager",
    "CountedQuerySet",
    "add",
    "add_many",
    "flush",
    "get_buffer",
    "get_client",
    "get_parts",
    "get_value",
    "get_values",
    "paused",
    "register",
    "track",
]
