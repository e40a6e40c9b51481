"""The buffer: pending and in-flight deltas of one key prefix in one Redis.

This module is plain Python: a :class:`Buffer` takes a redis-py client (or a
:class:`~counters.buffer.cluster.ClusterClient`), a key prefix and a shard
count, and knows nothing of Django settings or models. Its methods come by
concern: keys and scripts (:mod:`~counters.buffer.keyspace`, which also
describes the layout in Redis), pushes and fences
(:mod:`~counters.buffer.intake`), batches of the flush
(:mod:`~counters.buffer.batches`), quarantined deltas
(:mod:`~counters.buffer.aside`) and reads (:mod:`~counters.buffer.snapshots`).
"""

from __future__ import annotations

from counters.buffer.aside import QUARANTINE_ERROR_LIMIT, Aside, Quarantined
from counters.buffer.batches import Batch, Batches
from counters.buffer.cluster import Client
from counters.buffer.intake import PUSH_MARKER_TTL_MS, PUSH_MAX_AGE_MS, Intake
from counters.buffer.keyspace import SCORE_LIMIT, shard_of
from counters.buffer.scripts import (
    ACK_SCRIPT,
    DISCARD_SCRIPT,
    FENCE_SCRIPT,
    MOVE_SCRIPT,
    NARROW_SCRIPT,
    PUSH_SCRIPT,
    QUARANTINE_SCRIPT,
    READ_SCRIPT,
    REQUEUE_SCRIPT,
    SET_ASIDE_SCRIPT,
    DrainScript,
)
from counters.buffer.snapshots import Snapshot, Snapshots

__all__ = [
    "PUSH_MARKER_TTL_MS",
    "PUSH_MAX_AGE_MS",
    "QUARANTINE_ERROR_LIMIT",
    "SCORE_LIMIT",
    "Batch",
    "Buffer",
    "Quarantined",
    "Snapshot",
    "shard_of",
]


class Buffer(Intake, Batches, Aside, Snapshots):
    """Pending and in-flight deltas of one key prefix in one Redis."""

    def __init__(self, client: Client, prefix: str = "counters", shards: int = 16) -> None:
        super().__init__(client, prefix, shards)
        self._push = client.register_script(PUSH_SCRIPT)
        self._read = client.register_script(READ_SCRIPT)
        self._requeue = client.register_script(REQUEUE_SCRIPT)
        # The drain path: these run even when Redis is at maxmemory (see scripts.py).
        self._move = DrainScript(client, MOVE_SCRIPT)
        self._ack = DrainScript(client, ACK_SCRIPT)
        self._fence = DrainScript(client, FENCE_SCRIPT)
        self._narrow = DrainScript(client, NARROW_SCRIPT)
        self._quarantine = DrainScript(client, QUARANTINE_SCRIPT)
        self._discard = DrainScript(client, DISCARD_SCRIPT)
        self._set_aside = DrainScript(client, SET_ASIDE_SCRIPT)
