"""Buffered, exactly-once counters for Django.

Public API::

    import counters
    counters.register("unread", "notifications.UnreadCounter", key_field="user")
    counters.add("unread", user_id, +1)          # sent to Redis after COMMIT
    counters.get_value("unread", user_id)        # stored + buffered, exact
    counters.flush()                             # drain Redis into the rows
"""

from .api import add, add_many, flush, get_buffer, get_client
from .reads import get_parts, get_value, get_values
from .registry import register

__all__ = [
    "add",
    "add_many",
    "flush",
    "get_buffer",
    "get_client",
    "get_parts",
    "get_value",
    "get_values",
    "register",
]
