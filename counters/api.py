"""The public front of the counters app: one import for everything a caller needs.

The code lives by concern: :mod:`counters.client` (settings → Redis client
and Buffer), :mod:`counters.writes` (the write path and its fallback),
:mod:`counters.settle` (direct writes whose push may still arrive),
:mod:`counters.reads`, :mod:`counters.flushing` (flush entry points) and
:mod:`counters.rebuild`.
"""

from __future__ import annotations

from .client import buffer_prefix, databases, get_buffer, get_client
from .exceptions import (
    BufferUnavailable,
    CountersError,
    FlushFailed,
    InconsistentRead,
    InvalidKey,
    NotConnected,
    RebuildRunning,
    RedisTooOld,
    ScoreLimitExceeded,
    StalePush,
    TrackingError,
    UnexpectedScriptReply,
    UnknownCounter,
)
from .flushing import flush, flush_databases, record_flush
from .reads import get_parts, get_value, get_values
from .rebuild import rebuild, rebuild_all, rebuild_lease, repair_queued
from .settle import settle_fallbacks
from .writes import add, add_many, send, write_direct

__all__ = [
    "BufferUnavailable",
    "CountersError",
    "FlushFailed",
    "InconsistentRead",
    "InvalidKey",
    "NotConnected",
    "RebuildRunning",
    "RedisTooOld",
    "ScoreLimitExceeded",
    "StalePush",
    "TrackingError",
    "UnexpectedScriptReply",
    "UnknownCounter",
    "add",
    "add_many",
    "buffer_prefix",
    "databases",
    "flush",
    "flush_databases",
    "get_buffer",
    "get_client",
    "get_parts",
    "get_value",
    "get_values",
    "rebuild",
    "rebuild_all",
    "rebuild_lease",
    "record_flush",
    "repair_queued",
    "send",
    "settle_fallbacks",
    "write_direct",
]
