"""The keys of a buffer in Redis: one prefix, its shards, and the scripts run on them.

Layout per shard ``N`` (every key of a shard shares the hash tag ``{sN}`` so
each script touches one Redis Cluster slot)::

    <prefix>:{sN}:pending        ZSET  member "<counter>:<key>" -> summed delta
    <prefix>:{sN}:inflight       ZSET  the batch being applied, same shape
    <prefix>:{sN}:batch          HASH  id -> batch id, ts -> move time (ms), seq -> its sequence
    <prefix>:{sN}:gen            STR   bumped by every move and ack (read consistency)
    <prefix>:{sN}:since          STR   ms time the pending set last became non-empty (lag)
    <prefix>:{sN}:seq            STR   sequence of the last batch moved; the DB keeps the
                                       highest applied: Redis behind it went back in time
    <prefix>:{sN}:epoch          STR   token that vanishes if Redis loses its data (epoch.py)
    <prefix>:{sN}:lease          STR   flusher lease token (see lease.py)
    <prefix>:{sN}:w:<writer>     HASH  seq -> highest push of the writer applied here, fenced ->
                                       lowest push fenced (a push the writer gave up on); lives
                                       PUSH_MARKER_TTL_MS after its last push: one key per
                                       writer, however many pushes (pushids.py)
    <prefix>:{sN}:quarantine     HASH  "<batch id>|<member>" -> JSON {member, delta, error, at}:
                                       deltas that failed alone, kept until retried or discarded
    <prefix>:{sN}:qsum           ZSET  member -> sum of its quarantined deltas, kept with the
                                       quarantine by the same scripts: reads count it as buffered
    <prefix>:{sN}:suspects       HASH  member -> pushes that changed it since an audit or
                                       rebuild marked it (verify/drift.py); short-lived

Per prefix (no hash tag, single-key commands only)::

    <prefix>:last_flush          HASH  result of the last whole flush (status.py)
    <prefix>:flush_run           HASH  the newest parallel run: its id, parts and each part's
                                       result (fanout.py)
    <prefix>:repair              SET   members read below zero; the next flush rebuilds them
    <prefix>:rebuild             STR   lease of the full rebuild and of repairs (rebuild.py)
"""

from __future__ import annotations

import functools
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from counters.base.utils import to_str
from counters.buffer.cluster import Client
from counters.buffer.scripts import DrainScript

#: Scores are doubles: integers are exact below this magnitude (the scripts' ``limit``).
SCORE_LIMIT = 2**53


def shard_of(member: str, shards: int) -> int:
    return zlib.crc32(member.encode()) % shards


def int_reply(value: bytes | str | float | int) -> int:
    """An integer from a Redis reply: ``b"12"``, ``"12"``, ``12``, or a score as ``1.5e+17``."""
    try:
        return int(value)  # b"12" and "12" parse directly
    except ValueError:
        return int(float(to_str(value) if isinstance(value, bytes | str) else value))  # 1.5e+17


class Keyspace:
    """The keys of one prefix's shards in one Redis, and the scripts run on them."""

    def __init__(self, client: Client, prefix: str = "counters", shards: int = 16) -> None:
        if shards < 1:
            raise ValueError("shards must be at least 1")
        self.client = client
        self.prefix = prefix
        self.shards = shards
        #: (shard, writer) -> the keys of its pushes and the start of a one-member push's
        #: command (:meth:`Intake._push_entry`).
        self._push_keys_cache: dict[tuple[int, str], tuple[tuple[str, ...], str]] = {}
        #: The same for pushes of live members, with the start of their shard's channels as a
        #: fifth key (:meth:`Intake._live_entry`).
        self._live_keys_cache: dict[tuple[int, str], tuple[tuple[str, ...], str]] = {}
        # redis-py's ``evalsha()`` inspects its arguments for deprecations on every
        # call, a quarter of a push's client time: a plain client takes the command
        # as is. (The cluster client routes ``evalsha`` by key itself.)
        self._evalsha: Callable[..., Any] = (
            functools.partial(client.execute_command, "EVALSHA")
            if isinstance(client, redis.Redis)
            else client.evalsha
        )

    def _run(
        self, script: Script | DrainScript, calls: Sequence[tuple[Sequence[Any], list]]
    ) -> list:
        """Run ``script`` once per (keys, args) in one round trip.

        A single call goes straight to EVALSHA; several go in a pipeline of
        EVALSHAs. (redis-py's Script objects in a pipeline ask SCRIPT EXISTS
        on every execute, an extra round trip on the hot path.) Every script
        here is safe to repeat, so after NOSCRIPT (a restarted Redis) the
        scripts are loaded and the calls sent again.
        """
        if isinstance(script, DrainScript):
            script = script.resolve()
        for attempt in (1, 2):
            try:
                if len(calls) == 1:
                    keys, args = calls[0]
                    return [self._evalsha(script.sha, len(keys), *keys, *args)]
                pipe = self.client.pipeline(transaction=False)
                for keys, args in calls:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                return pipe.execute()
            except NoScriptError:
                if attempt == 2:
                    raise
                self.client.script_load(script.script)
        raise AssertionError("unreachable")

    def key(self, shard: int, name: str) -> str:
        return f"{self.prefix}:{{s{shard}}}:{name}"

    def _shard_keys(self, shard: int) -> list[str]:
        return [self.key(shard, n) for n in ("pending", "inflight", "batch", "gen", "since")]

    def shard_of(self, member: str) -> int:
        return shard_of(member, self.shards)

    def by_shard(self, members: Iterable[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = defaultdict(list)
        for member in members:
            groups[self.shard_of(member)].append(member)
        return groups

    def writer_key(self, shard: int, writer: str) -> str:
        """The key of ``writer``'s high-water mark in ``shard``."""
        return self.key(shard, f"w:{writer}")
