"""Buffered, exactly-once counters for Django: the one public import path.

::

    import counters
    counters.track("post_comments", Comment, key="post",       # count rows of any model
                   into="blog.PostStats.comments", where=Q(approved=True))
    counters.get_value("post_comments", post.pk)                # stored + buffered, exact
    await counters.aget_value("post_comments", post.pk)         # the same, from async code
    async for n in counters.awatch("unread", user.pk): ...      # a live counter's each change
    counters.flush()                                            # drain Redis into the rows
    with counters.paused(): ...                                 # a data migration, uncounted

    counters.register("unread", "notifications.UnreadCounter", key_field="user")
    counters.add("unread", user_id, +1)                         # by hand, sent after COMMIT

Declare
    ``track`` (count rows of a model), ``register`` (a counter written by hand),
    ``get_spec`` (a declared counter: its model, key and truth source),
    ``CountedManager`` and ``CountedQuerySet`` (the counted QuerySet paths),
    ``paused`` (a block whose changes are not counted), ``rows_changed`` (the
    signal sent with the old and new values of the rows a counted path changed).
Write
    ``add``, ``add_many``: deltas sent after COMMIT.
Read
    ``get_value``, ``get_values`` (stored + buffered, exact), ``get_parts``;
    ``aget_value``, ``aget_values``: the same from async code; ``awatch``: a live
    counter's exact value at once and after every change (``track(..., live=True)``).
Operate
    ``flush`` (drain the buffer into the rows), ``rebuild``, ``rebuild_all``
    (repair from the truth), ``audit`` (one run of the continuous audit),
    ``push_queued`` and ``drain_queues`` (this process's sender queue: push it now; push
    it and stop, from a server's worker-exit hook), ``get_buffer`` and
    ``get_client`` (the Redis buffer and client the settings give).
Signals
    ``counters.signals.applied``: sent after a transaction that changed counter rows
    commits (:mod:`counters.write.changes`).
Exceptions
    ``CountersError`` and its subclasses; ``NotConnected`` (Redis could not be
    reached, nothing was sent).

Importing ``counters`` loads no other module of the app: each name is imported
from the module that defines it on first use (PEP 562), then kept in this
module's globals. ``_EXPORTS`` is the whole map; ``__all__`` is its keys.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from counters.base.context import paused
    from counters.base.exceptions import (
        BufferUnavailable,
        CountersError,
        FlushFailed,
        InconsistentRead,
        InvalidKey,
        LayoutChangePending,
        NotConnected,
        NotLive,
        RebuildRunning,
        RedisTooOld,
        RepairFenced,
        ScoreLimitExceeded,
        StalePush,
        TrackedTooEarly,
        TrackingError,
        UnexpectedScriptReply,
        UnknownCounter,
    )
    from counters.base.registry import get_spec, register
    from counters.client import get_buffer, get_client
    from counters.ops.run import flush
    from counters.read.values import aget_value, aget_values, get_parts, get_value, get_values
    from counters.read.watch import awatch
    from counters.tracking.counting import rows_changed
    from counters.tracking.declare import track
    from counters.tracking.queryset import CountedManager, CountedQuerySet
    from counters.verify.audit import audit
    from counters.verify.rebuild import rebuild, rebuild_all
    from counters.write.add import add, add_many
    from counters.write.sender import drain_queues, push_queued

#: Public name → the module that defines it under that name.
_EXPORTS: dict[str, str] = {
    # declare
    "track": "counters.tracking.declare",
    "register": "counters.base.registry",
    "get_spec": "counters.base.registry",
    "CountedManager": "counters.tracking.queryset",
    "CountedQuerySet": "counters.tracking.queryset",
    "paused": "counters.base.context",
    "rows_changed": "counters.tracking.counting",
    # write
    "add": "counters.write.add",
    "add_many": "counters.write.add",
    # read
    "get_value": "counters.read.values",
    "get_values": "counters.read.values",
    "get_parts": "counters.read.values",
    "aget_value": "counters.read.values",
    "aget_values": "counters.read.values",
    "awatch": "counters.read.watch",
    # operate
    "flush": "counters.ops.run",
    "rebuild": "counters.verify.rebuild",
    "rebuild_all": "counters.verify.rebuild",
    "audit": "counters.verify.audit",
    "push_queued": "counters.write.sender",
    "drain_queues": "counters.write.sender",
    "get_buffer": "counters.client",
    "get_client": "counters.client",
    # exceptions
    "CountersError": "counters.base.exceptions",
    "UnknownCounter": "counters.base.exceptions",
    "NotLive": "counters.base.exceptions",
    "InvalidKey": "counters.base.exceptions",
    "BufferUnavailable": "counters.base.exceptions",
    "NotConnected": "counters.base.exceptions",
    "InconsistentRead": "counters.base.exceptions",
    "StalePush": "counters.base.exceptions",
    "ScoreLimitExceeded": "counters.base.exceptions",
    "UnexpectedScriptReply": "counters.base.exceptions",
    "RedisTooOld": "counters.base.exceptions",
    "FlushFailed": "counters.base.exceptions",
    "RebuildRunning": "counters.base.exceptions",
    "RepairFenced": "counters.base.exceptions",
    "TrackingError": "counters.base.exceptions",
    "TrackedTooEarly": "counters.base.exceptions",
    "LayoutChangePending": "counters.base.exceptions",
}

__all__ = [
    "BufferUnavailable",
    "CountedManager",
    "CountedQuerySet",
    "CountersError",
    "FlushFailed",
    "InconsistentRead",
    "InvalidKey",
    "LayoutChangePending",
    "NotConnected",
    "NotLive",
    "RebuildRunning",
    "RedisTooOld",
    "RepairFenced",
    "ScoreLimitExceeded",
    "StalePush",
    "TrackedTooEarly",
    "TrackingError",
    "UnexpectedScriptReply",
    "UnknownCounter",
    "add",
    "add_many",
    "aget_value",
    "aget_values",
    "audit",
    "awatch",
    "drain_queues",
    "flush",
    "get_buffer",
    "get_client",
    "get_parts",
    "get_spec",
    "get_value",
    "get_values",
    "paused",
    "push_queued",
    "rebuild",
    "rebuild_all",
    "register",
    "rows_changed",
    "track",
]


def __getattr__(name: str) -> Any:
    """Import public ``name`` from its module on first use and keep it here."""
    if name == "signals":  # the submodule of ``counters.signals.applied``, from any ready()
        value: Any = import_module("counters.signals")
        globals()[name] = value
        return value
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
