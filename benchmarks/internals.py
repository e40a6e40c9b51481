"""The internal parts of ``counters`` that the benchmarks drive directly.

Everything else the benchmarks use goes through ``import counters`` (model
classes through ``counters.models``, where Django puts them). What is here is
not API: measuring the flush against a raw SQL bound, the Redis memory of push
ids, a push through each of its layers, several flusher processes on disjoint
shards, or a read of another design
(the native async read of ``async_reads.py``) means driving that part itself,
on a buffer and prefix of the benchmark's own, with a flush that leaves the
shared ledger alone; no public function does that, nor should. This
module is the only place outside ``counters/`` and ``tests/`` that imports
them (``tests/app/test_front.py`` checks it), so a move inside ``counters/``
is followed here once.
"""

from __future__ import annotations

from redis import Redis

from counters.base import conf
from counters.base.utils import batched, column, first_line, model_field, to_str
from counters.buffer import live, pushids
from counters.buffer.cluster import ClusterClient
from counters.buffer.keyspace import int_reply
from counters.buffer.line import Line
from counters.buffer.scripts import PUSH_SCRIPT
from counters.buffer.store import PUSH_MARKER_TTL_MS, PUSH_MAX_AGE_MS, Buffer
from counters.flushing import lanes, shard
from counters.flushing.result import FlushResult
from counters.ops.fanout import flush_part, partition
from counters.read.values import _read_rows as read_rows
from counters.write import acks, delivery, replies, sender
from counters.write.apply import CHUNK
from counters.write.outbox import clear_landed
from counters.write.transactions import unsent

#: A Redis client as ``counters.get_client()`` returns it: one server or a cluster.
RedisClient = Redis | ClusterClient

__all__ = [
    "CHUNK",
    "PUSH_MARKER_TTL_MS",
    "PUSH_MAX_AGE_MS",
    "PUSH_SCRIPT",
    "Buffer",
    "ClusterClient",
    "FlushResult",
    "Line",
    "RedisClient",
    "acks",
    "batched",
    "clear_landed",
    "column",
    "conf",
    "delivery",
    "first_line",
    "flush_part",
    "int_reply",
    "lanes",
    "live",
    "model_field",
    "partition",
    "pushids",
    "read_rows",
    "replies",
    "sender",
    "shard",
    "to_str",
    "unsent",
]
