"""The Redis side of the pipeline: pending deltas, in-flight batches, reads.

This module is plain Python: a :class:`Buffer` takes a redis-py client, a key
prefix and a shard count, and knows nothing of Django settings or models.

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
                                       writer, however many pushes (writers.py)
    <prefix>:{sN}:quarantine     HASH  "<batch id>|<member>" -> JSON {member, delta, error, at}:
                                       deltas that failed alone, kept until retried or discarded
    <prefix>:{sN}:qsum           ZSET  member -> sum of its quarantined deltas, kept with the
                                       quarantine by the same scripts: reads count it as buffered

Per prefix (no hash tag, single-key commands only)::

    <prefix>:last_flush          HASH  result of the last whole flush (status.py)
    <prefix>:flush_run           HASH  the newest parallel run: its id, parts and each part's
                                       result (fanout.py)
    <prefix>:repair              SET   members read below zero; the next flush rebuilds them
    <prefix>:rebuild             STR   lease of the full rebuild and of repairs (api.rebuild_all)
"""

from __future__ import annotations

import functools
import json
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError, ResponseError

from .cluster import Client
from .exceptions import RedisTooOld, ScoreLimitExceeded, StalePush, UnexpectedScriptReply
from .scripts import DrainScript
from .utils import to_str
from .writers import PushId

# Add deltas to one shard's pending set as push ARGV[4] of writer KEYS[2], unless the writer's
# high-water mark is already there (a repeat, or an older push delivered late), the push is
# fenced, it is older than ARGV[3] ms (delivered late), or a sum would leave the exact range
# of a score. The writer's hash holds 'seq' (the highest push applied here) and 'fenced' (the
# lowest push fenced), and lives ARGV[1] ms after its last push or fence.
PUSH_SCRIPT = """
local pending, writer, since = KEYS[1], KEYS[2], KEYS[3]
local ttl, sent_at, max_age, seq = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local limit = 9007199254740992
local now = redis.call('TIME')
if (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)) - tonumber(sent_at)
    > tonumber(max_age) then
  return 2
end
local state = redis.call('HMGET', writer, 'seq', 'fenced')
if seq <= tonumber(state[1] or '0') then return 0 end
if state[2] and seq >= tonumber(state[2]) then return 0 end
local refused = {3}
for i = 5, #ARGV, 2 do
  local sum = tonumber(redis.call('ZSCORE', pending, ARGV[i]) or '0') + tonumber(ARGV[i + 1])
  if sum >= limit or sum <= -limit then refused[#refused + 1] = ARGV[i] end
end
if #refused > 1 then return refused end
redis.call('HSET', writer, 'seq', seq)
redis.call('PEXPIRE', writer, ttl)
redis.call('SET', since, sent_at, 'NX')
for i = 5, #ARGV, 2 do
  if tonumber(redis.call('ZINCRBY', pending, ARGV[i + 1], ARGV[i])) == 0 then
    redis.call('ZREM', pending, ARGV[i])
  end
end
return 1
"""

# Fence push ARGV[2] of writer KEYS[1] (its last: a writer is retired after a push it could
# not resolve): 1 if it was applied, else mark it so that it can never apply and return 0.
# KEYS[2], when given, is the marker key of a push id from before writer ids: applied if '1',
# else set to 'fenced'.
FENCE_SCRIPT = """
local writer, legacy = KEYS[1], KEYS[2]
local ttl, seq = ARGV[1], tonumber(ARGV[2])
local state = redis.call('HMGET', writer, 'seq', 'fenced')
if seq <= tonumber(state[1] or '0') then return 1 end
if legacy then
  local value = redis.call('GET', legacy)
  if value == '1' then return 1 end
  if not value then redis.call('SET', legacy, 'fenced', 'PX', ttl) end
end
if not state[2] or seq < tonumber(state[2]) then redis.call('HSET', writer, 'fenced', seq) end
redis.call('PEXPIRE', writer, ttl)
return 0
"""

# Forget in-flight batch ARGV[4] if it is still in flight (an ack, '' for none); then return
# the batch in flight, or move up to ARGV[2] pending members, lowest scores first (only
# members ARGV[5..] when given), into a new batch ARGV[1] tagged with the shard's next
# sequence number (epoch.py compares it with the DB's). Scores are returned as integers.
# Needs Redis 6.2 (ZRANGESTORE).
MOVE_SCRIPT = """
local pending, inflight, batch, gen = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local since, seq = KEYS[5], KEYS[6]
local batch_id, limit, now_ms, acked = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local current = redis.call('HGET', batch, 'id')
if current and current == acked then
  redis.call('DEL', inflight, batch)
  redis.call('INCR', gen)
  current = false
end
if current then
  local info = redis.call('HMGET', batch, 'ts', 'seq')
  local flat = redis.call('ZRANGE', inflight, 0, -1, 'WITHSCORES')
  for i = 2, #flat, 2 do flat[i] = tonumber(flat[i]) end
  return {'inflight', current, info[1], flat, info[2] or '0'}
end
local items = {}
if #ARGV > 4 then
  local chunk, found = {}, 0
  for i = 5, math.min(#ARGV, limit + 4) do
    local score = redis.call('ZSCORE', pending, ARGV[i])
    if score then
      redis.call('ZREM', pending, ARGV[i])
      found = found + 1
      if tonumber(score) ~= 0 then
        items[#items + 1] = ARGV[i]
        items[#items + 1] = tonumber(score)
        chunk[#chunk + 1] = score
        chunk[#chunk + 1] = ARGV[i]
        if #chunk >= 1000 then redis.call('ZADD', inflight, unpack(chunk)); chunk = {} end
      end
    end
  end
  if #chunk > 0 then redis.call('ZADD', inflight, unpack(chunk)) end
  if redis.call('EXISTS', pending) == 0 then redis.call('DEL', since) end
  if found == 0 then return {'empty'} end
else
  -- the lowest scores first, as ZPOPMIN; copied and removed in C, not member by member
  local moved = redis.call('ZRANGESTORE', inflight, pending, 0, limit - 1)
  if moved == 0 then return {'empty'} end
  redis.call('ZREMRANGEBYRANK', pending, 0, limit - 1)
  redis.call('ZREMRANGEBYSCORE', inflight, 0, 0)  -- zero sums are dropped, never applied
  if redis.call('EXISTS', pending) == 0 then redis.call('DEL', since) end
  items = redis.call('ZRANGE', inflight, 0, -1, 'WITHSCORES')
  for i = 2, #items, 2 do items[i] = tonumber(items[i]) end
end
local number = 0
if #items > 0 then
  number = redis.call('INCR', seq)
  redis.call('HSET', batch, 'id', batch_id, 'ts', now_ms, 'seq', number)
  redis.call('INCR', gen)
end
return {'moved', batch_id, now_ms, items, number}
"""

# Forget in-flight batch ARGV[1] only if it is still the batch in flight.
ACK_SCRIPT = """
local inflight, batch, gen = KEYS[1], KEYS[2], KEYS[3]
local batch_id = ARGV[1]
if redis.call('HGET', batch, 'id') == batch_id then
  redis.call('DEL', inflight, batch)
  redis.call('INCR', gen)
  return 1
end
return 0
"""

# Snapshot for reads: generation, batch id in flight, pending, in-flight and quarantined sum
# per member, then the high-water mark of each writer KEYS[7..] ('0' when absent).
READ_SCRIPT = """
local pending, inflight, batch, gen, qsum = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6]
local members, first_writer = ARGV, 7
local out = {redis.call('GET', gen) or '0', redis.call('HGET', batch, 'id') or ''}
for _, member in ipairs(members) do
  out[#out + 1] = redis.call('ZSCORE', pending, member) or '0'
  out[#out + 1] = redis.call('ZSCORE', inflight, member) or '0'
  out[#out + 1] = redis.call('ZSCORE', qsum, member) or '0'
end
for i = first_writer, #KEYS do
  out[#out + 1] = redis.call('HGET', KEYS[i], 'seq') or '0'
end
return out
"""

# Narrow in-flight batch ARGV[1] to a batch ARGV[2]: members ARGV[4..] go back to pending
# unless their pending sum would leave the exact range of a score. With sequence KEYS[6], the
# narrowed batch takes the shard's next sequence number (so that the DB, applying it, records
# a number no Redis state from before the narrowing has); {1, items left, that number or 0}
# or {0}.
NARROW_SCRIPT = """
local pending, inflight, batch, gen, since = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local seq = KEYS[6]
local batch_id, new_id, now_ms = ARGV[1], ARGV[2], ARGV[3]
local limit = 9007199254740992
if redis.call('HGET', batch, 'id') ~= batch_id then return {0} end
local returned = 0
for i = 4, #ARGV do
  local member = ARGV[i]
  local delta = redis.call('ZSCORE', inflight, member)
  if delta then
    local sum = tonumber(redis.call('ZSCORE', pending, member) or '0') + tonumber(delta)
    if sum < limit and sum > -limit then
      redis.call('ZREM', inflight, member)
      if tonumber(redis.call('ZINCRBY', pending, delta, member)) == 0 then
        redis.call('ZREM', pending, member)
      end
      returned = returned + 1
    end
  end
end
if returned > 0 then redis.call('SET', since, now_ms, 'NX') end
local number = 0
if seq then
  number = redis.call('INCR', seq)
  redis.call('HSET', batch, 'seq', number)
end
redis.call('HSET', batch, 'id', new_id)
redis.call('INCR', gen)
return {1, redis.call('ZRANGE', inflight, 0, -1, 'WITHSCORES'), number}
"""

# Quarantine in-flight batch ARGV[1]: for each (field, value, member, delta) in ARGV[2..], store
# the field and add delta to the member's quarantined sum KEYS[5]; forget the batch. Only if it
# is still the batch in flight; 1 if so, else 0.
QUARANTINE_SCRIPT = """
local inflight, batch, gen, quarantine, qsum = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local batch_id = ARGV[1]
if redis.call('HGET', batch, 'id') ~= batch_id then return 0 end
for i = 2, #ARGV, 4 do
  if redis.call('HSET', quarantine, ARGV[i], ARGV[i + 1]) == 1 then
    if tonumber(redis.call('ZINCRBY', qsum, ARGV[i + 3], ARGV[i + 2])) == 0 then
      redis.call('ZREM', qsum, ARGV[i + 2])
    end
  end
end
redis.call('DEL', inflight, batch)
redis.call('INCR', gen)
return 1
"""

# Put quarantined deltas back: for each (field, member, delta, uncount) in ARGV[2..] whose
# field is still quarantined, add delta to the pending member, uncount (minus the part of delta
# in the member's quarantined sum KEYS[4]) to that sum and drop the field, unless the pending
# sum would leave the exact range of a score; returns {requeued count, refused fields...}.
REQUEUE_SCRIPT = """
local pending, quarantine, since, qsum = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now_ms = ARGV[1]
local limit = 9007199254740992
local out = {0}
for i = 2, #ARGV, 4 do
  local field, member, delta, uncount = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if redis.call('HEXISTS', quarantine, field) == 1 then
    local sum = tonumber(redis.call('ZSCORE', pending, member) or '0') + tonumber(delta)
    if sum >= limit or sum <= -limit then
      out[#out + 1] = field
    else
      redis.call('HDEL', quarantine, field)
      if tonumber(redis.call('ZINCRBY', pending, delta, member)) == 0 then
        redis.call('ZREM', pending, member)
      end
      if tonumber(uncount) ~= 0 and tonumber(redis.call('ZINCRBY', qsum, uncount, member)) == 0
      then
        redis.call('ZREM', qsum, member)
      end
      out[1] = out[1] + 1
    end
  end
end
if out[1] > 0 then redis.call('SET', since, now_ms, 'NX') end
return out
"""

# Drop quarantined deltas for good: for each (field, member, uncount) in ARGV whose field is
# still quarantined, drop it and add uncount (minus the part of its delta in the member's
# quarantined sum) to the quarantined sum KEYS[2]; returns how many were dropped.
DISCARD_SCRIPT = """
local quarantine, qsum = KEYS[1], KEYS[2]
local dropped = 0
for i = 1, #ARGV, 3 do
  local field, member, uncount = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HDEL', quarantine, field) == 1 then
    dropped = dropped + 1
    if tonumber(uncount) ~= 0 and tonumber(redis.call('ZINCRBY', qsum, uncount, member)) == 0
    then
      redis.call('ZREM', qsum, member)
    end
  end
end
return dropped
"""

# Quarantine deltas that never entered Redis: for each (field, value, member, delta) in ARGV,
# set the field in the quarantine KEYS[1] and, if it was not there yet, add delta to the
# member's quarantined sum KEYS[2] (so writing the same fields again adds nothing); returns
# how many fields were new.
SET_ASIDE_SCRIPT = """
local quarantine, qsum = KEYS[1], KEYS[2]
local added = 0
for i = 1, #ARGV, 4 do
  local field, value, member, delta = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if redis.call('HSET', quarantine, field, value) == 1 then
    added = added + 1
    if tonumber(delta) ~= 0 and tonumber(redis.call('ZINCRBY', qsum, delta, member)) == 0 then
      redis.call('ZREM', qsum, member)
    end
  end
end
return added
"""

#: A push delivered later than this after it was sent is refused (a late TCP delivery
#: after the writer gave up and wrote to the DB instead).
PUSH_MAX_AGE_MS = 30_000
#: How long a writer's high-water mark is kept after its last push or fence; longer than
#: PUSH_MAX_AGE_MS plus the time a flush needs to fence the pushes of fallback writes.
PUSH_MARKER_TTL_MS = 180_000
#: Scores are doubles: integers are exact below this magnitude (the script's ``limit``).
SCORE_LIMIT = 2**53
#: Longest error text kept with a quarantined delta.
QUARANTINE_ERROR_LIMIT = 300


@dataclass(frozen=True)
class Batch:
    """Deltas moved to a shard's in-flight set under one id.

    ``recovered`` is True when the batch was already in flight (a previous
    flusher moved it and did not acknowledge it). ``seq`` is the shard's
    sequence number of the batch (0 for an empty move), ``prefix`` the key
    prefix of the buffer it came from.
    """

    shard: int
    batch_id: str
    moved_at_ms: int
    items: dict[str, int]
    recovered: bool
    seq: int = 0
    prefix: str = ""


@dataclass(frozen=True)
class Snapshot:
    """What Redis holds for some members at one instant.

    ``hwms`` has the high-water mark of each writer of the requested push
    ids (and of their take-backs) in each shard read: (shard, writer) ->
    highest sequence number applied there (0: none, or forgotten).
    """

    gens: dict[int, int]
    inflight_ids: dict[int, str]
    pending: dict[str, int]
    inflight: dict[str, int]
    hwms: dict[tuple[int, str], int] = field(default_factory=dict)
    #: Sum of each member's quarantined deltas: not applied, not lost, part of its value.
    quarantined: dict[str, int] = field(default_factory=dict)

    def applied(self, shard: int, push_id: PushId | str) -> bool:
        """Did push ``push_id`` apply in ``shard``? (For the last push of its writer:
        the writer of an unsettled direct write was retired with it.)"""
        push_id = PushId.of(push_id)
        return self.hwms.get((shard, push_id.writer), 0) >= push_id.seq


@dataclass(frozen=True)
class Quarantined:
    """A delta that failed to apply on its own, held in its shard's quarantine hash.

    ``field`` is its key in the hash, ``"<batch id>|<member>"``: the batch
    it failed in makes it unique, and quarantining it again after a crash
    writes the same field. ``counted`` says the delta is in its member's
    quarantined sum (``qsum``), as every delta quarantined since that sum exists is.
    """

    shard: int
    field: str
    member: str
    delta: int
    error: str
    at: float
    counted: bool = True

    @property
    def uncount(self) -> int:
        """What taking it out of the quarantine adds to its member's quarantined sum."""
        return -self.delta if self.counted else 0

    @property
    def counter(self) -> str:
        return self.member.partition(":")[0]


def shard_of(member: str, shards: int) -> int:
    return zlib.crc32(member.encode()) % shards


def _int(value: bytes | str | float | int) -> int:
    try:
        return int(value)  # b"12" and "12" parse directly
    except ValueError:
        return int(float(to_str(value) if isinstance(value, bytes | str) else value))  # 1.5e+17


class Buffer:
    """Pending and in-flight deltas of one key prefix in one Redis."""

    def __init__(self, client: Client, prefix: str = "counters", shards: int = 16) -> None:
        if shards < 1:
            raise ValueError("shards must be at least 1")
        self.client = client
        self.prefix = prefix
        self.shards = shards
        # redis-py's ``evalsha()`` inspects its arguments for deprecations on every
        # call, a quarter of a push's client time: a plain client takes the command
        # as is. (The cluster client routes ``evalsha`` by key itself.)
        self._evalsha: Callable[..., Any] = (
            functools.partial(client.execute_command, "EVALSHA")
            if isinstance(client, redis.Redis)
            else client.evalsha
        )
        self._push = client.register_script(PUSH_SCRIPT)
        self._read = client.register_script(READ_SCRIPT)
        self._requeue = client.register_script(REQUEUE_SCRIPT)
        self._discard = DrainScript(client, DISCARD_SCRIPT)
        self._set_aside = DrainScript(client, SET_ASIDE_SCRIPT)
        # The drain path: these run even when Redis is at maxmemory (see scripts.py).
        self._move = DrainScript(client, MOVE_SCRIPT)
        self._ack = DrainScript(client, ACK_SCRIPT)
        self._fence = DrainScript(client, FENCE_SCRIPT)
        self._narrow = DrainScript(client, NARROW_SCRIPT)
        self._quarantine = DrainScript(client, QUARANTINE_SCRIPT)

    def _run(self, script: Script | DrainScript, calls: list[tuple[list, list]]) -> list:
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

    # -- keys ---------------------------------------------------------------
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

    # -- write path -----------------------------------------------------------
    def writer_key(self, shard: int, writer: str) -> str:
        """The key of ``writer``'s high-water mark in ``shard``."""
        return self.key(shard, f"w:{writer}")

    def push(self, deltas: Mapping[str, int], push_id: PushId | str) -> set[int]:
        """Add ``deltas`` ({member: delta}) in one round trip, one atomic script per shard.

        ``push_id`` (a :class:`~counters.writers.PushId`; text is read with
        :meth:`PushId.of`) makes the call idempotent: each shard applies a
        writer's pushes only in increasing order, so repeating the call (after
        a lost reply) adds nothing twice, and neither does an older push of the
        same writer delivered late. Returns the shards this call changed (a
        shard that already had this push is left out).

        A score is a double, exact for integers below 2**53 in magnitude. A
        delta that large is never sent, and a shard where some member's sum
        would reach it adds nothing: :class:`ScoreLimitExceeded` then names
        those members. The caller applies them elsewhere and pushes the rest
        again with the same id, which completes the refused shards only.
        """
        pid = PushId.of(push_id)
        groups: dict[int, list[str | int]] = defaultdict(list)
        refused: dict[str, int] = {}
        for member, delta in deltas.items():
            if not delta:
                continue
            if abs(delta) >= SCORE_LIMIT:
                refused[member] = int(delta)
            else:
                groups[self.shard_of(member)].extend((member, int(delta)))
        changed: set[int] = set()
        if groups:
            now_ms = int(time.time() * 1000)
            calls = [
                (
                    [
                        self.key(shard, "pending"),
                        self.writer_key(shard, pid.writer),
                        self.key(shard, "since"),
                    ],
                    [PUSH_MARKER_TTL_MS, now_ms, PUSH_MAX_AGE_MS, pid.seq, *args],
                )
                for shard, args in groups.items()
            ]
            replies = self._run(self._push, calls)
            codes = []
            for args, reply in zip(groups.values(), replies, strict=True):
                if isinstance(reply, list) and reply and reply[0] == 3:
                    members = [to_str(m) for m in reply[1:]]
                    if not members or not set(members) <= set(args[::2]):
                        raise UnexpectedScriptReply("PUSH_SCRIPT", replies)
                    refused.update((m, int(deltas[m])) for m in members)
                    codes.append(3)
                elif reply in (0, 1, 2):
                    codes.append(reply)
                else:
                    raise UnexpectedScriptReply("PUSH_SCRIPT", replies)
            if 2 in codes:
                raise StalePush(str(push_id))
            changed = {shard for shard, code in zip(groups, codes, strict=True) if code == 1}
        if refused:
            raise ScoreLimitExceeded(str(push_id), refused, changed)
        return changed

    def fence(self, members: Iterable[str], push_id: PushId | str) -> set[int]:
        """Make push ``push_id`` of ``members`` unable to apply from now on.

        ``push_id`` must be the last push of its writer (the writer was retired
        after it). Returns the shards where it had already been applied (a
        late delivery of a push the writer gave up on). Text that is not a
        ``"<writer>:<seq>"`` id also fences the marker key such an id had
        before writer ids (``push:<id>``), for direct writes made before them.
        """
        pid = PushId.of(push_id)
        legacy = isinstance(push_id, str) and str(pid) != push_id
        shards = sorted(self.by_shard(members))
        calls = []
        for shard in shards:
            keys = [self.writer_key(shard, pid.writer)]
            if legacy:
                keys.append(self.key(shard, f"push:{push_id}"))
            calls.append((keys, [PUSH_MARKER_TTL_MS, pid.seq]))
        replies = self._run(self._fence, calls) if calls else []
        if any(reply not in (0, 1) for reply in replies):
            raise UnexpectedScriptReply("FENCE_SCRIPT", replies)
        return {shard for shard, reply in zip(shards, replies, strict=True) if reply == 1}

    # -- flush path -----------------------------------------------------------
    def pending_count(self, shard: int) -> int:
        return int(self.client.zcard(self.key(shard, "pending")))

    def move(
        self,
        shard: int,
        batch_id: str,
        limit: int,
        only: Iterable[str] = (),
        ack: str | None = None,
    ) -> Batch | None:
        """Move up to ``limit`` pending members into a new in-flight batch.

        With ``only``, just those members that are pending are moved (members
        a narrowed batch sent back, see :meth:`narrow`). If a batch is already
        in flight it is returned instead (``recovered``); None means the
        shard had nothing (of ``only``) pending. ``ack`` first forgets that
        batch if it is still in flight, as :meth:`ack` does, in the same
        script: the flush acknowledges a batch with the move of the next.
        """
        now_ms = int(time.time() * 1000)
        keys = [*self._shard_keys(shard), self.key(shard, "seq")]
        try:
            reply = self._move(keys=keys, args=[batch_id, limit, now_ms, ack or "", *only])
        except ResponseError as exc:
            # Redis before 6.2 refuses the script's ZRANGESTORE (6.0 without naming it).
            message = str(exc).lower()
            if "zrangestore" in message or "unknown redis command" in message:
                raise RedisTooOld("ZRANGESTORE") from exc
            raise
        status = to_str(reply[0])
        if status == "empty":
            return None
        if status not in ("inflight", "moved"):
            raise UnexpectedScriptReply("MOVE_SCRIPT", reply)
        flat = reply[3]
        members = flat[0::2]
        scores = flat[1::2]
        items = dict(
            zip(
                map(bytes.decode, members)
                if members and isinstance(members[0], bytes)
                else map(to_str, members),
                scores if all(type(v) is int for v in scores) else map(_int, scores),
                strict=True,
            )
        )
        return Batch(
            shard=shard,
            batch_id=to_str(reply[1]),
            moved_at_ms=_int(reply[2]),
            items=items,
            recovered=status == "inflight",
            seq=_int(reply[4]),
            prefix=self.prefix,
        )

    def ack(self, shard: int, batch_id: str) -> bool:
        """Drop the in-flight batch if it is still ``batch_id``; False if it was not."""
        keys = [self.key(shard, "inflight"), self.key(shard, "batch"), self.key(shard, "gen")]
        reply = self._ack(keys=keys, args=[batch_id])
        if reply not in (0, 1):
            raise UnexpectedScriptReply("ACK_SCRIPT", reply)
        return reply == 1

    def narrow(
        self, batch: Batch, new_id: str, returned: Iterable[str], renumber: bool = False
    ) -> Batch | None:
        """Send ``returned`` members of in-flight ``batch`` back to pending; keep the rest
        in flight as batch ``new_id``.

        The narrowed batch keeps the sequence number of ``batch``, or with
        ``renumber`` takes the shard's next one, in the same script: the flush
        renumbers, so that a Redis restored from a state older than the
        narrowing is behind the DB once the narrowed batch is applied (see
        :mod:`counters.epoch`). A member whose pending sum would leave the
        exact range of a score stays in flight. Returns the narrowed batch, or
        None if ``batch`` is no longer the batch in flight.
        """
        shard = batch.shard
        keys = [
            self.key(shard, "pending"),
            self.key(shard, "inflight"),
            self.key(shard, "batch"),
            self.key(shard, "gen"),
            self.key(shard, "since"),
        ]
        if renumber:
            keys.append(self.key(shard, "seq"))
        now_ms = int(time.time() * 1000)
        reply = self._narrow(keys=keys, args=[batch.batch_id, new_id, now_ms, *returned])
        if reply == [0]:
            return None
        if not (isinstance(reply, list) and len(reply) == 3 and reply[0] == 1):
            raise UnexpectedScriptReply("NARROW_SCRIPT", reply)
        flat, number = reply[1], _int(reply[2])
        items = {to_str(flat[i]): _int(flat[i + 1]) for i in range(0, len(flat), 2)}
        if not set(items) <= set(batch.items) or (number > 0) != renumber:
            raise UnexpectedScriptReply("NARROW_SCRIPT", reply)
        return Batch(
            shard=shard,
            batch_id=new_id,
            moved_at_ms=batch.moved_at_ms,
            items=items,
            recovered=batch.recovered,
            seq=number or batch.seq,
            prefix=batch.prefix,
        )

    def quarantine(self, batch: Batch, error: str) -> bool:
        """Move every member of in-flight ``batch`` into the shard's quarantine with
        ``error``, and forget the batch. False if it is no longer the batch in flight."""
        shard = batch.shard
        keys = [
            self.key(shard, "inflight"),
            self.key(shard, "batch"),
            self.key(shard, "gen"),
            self.key(shard, "quarantine"),
            self.key(shard, "qsum"),
        ]
        error = error[:QUARANTINE_ERROR_LIMIT]
        at = round(time.time(), 3)
        args: list[str | int] = [batch.batch_id]
        for member, delta in sorted(batch.items.items()):
            value = {"member": member, "delta": delta, "error": error, "at": at, "counted": True}
            args.extend((f"{batch.batch_id}|{member}", json.dumps(value), member, delta))
        reply = self._quarantine(keys=keys, args=args)
        if reply not in (0, 1):
            raise UnexpectedScriptReply("QUARANTINE_SCRIPT", reply)
        return reply == 1

    def quarantined(self, shards: Iterable[int] | None = None) -> list[Quarantined]:
        """Every quarantined delta of ``shards`` (default: all), oldest first."""
        shards = list(range(self.shards) if shards is None else shards)
        pipe = self.client.pipeline(transaction=False)
        for shard in shards:
            pipe.hgetall(self.key(shard, "quarantine"))
        entries = []
        for shard, raw in zip(shards, pipe.execute(), strict=True):
            for field_, value in raw.items():
                data = json.loads(value)
                entries.append(
                    Quarantined(
                        shard=shard,
                        field=to_str(field_),
                        member=str(data["member"]),
                        delta=int(data["delta"]),
                        error=str(data.get("error", "")),
                        at=float(data.get("at", 0)),
                        counted=bool(data.get("counted", False)),
                    )
                )
        entries.sort(key=lambda e: (e.at, e.field))
        return entries

    def requeue(self, entries: Iterable[Quarantined]) -> tuple[int, list[Quarantined]]:
        """Put quarantined deltas back into pending, each at most once (atomic per shard).

        Returns how many were put back, and the entries left in quarantine
        because their pending sum would leave the exact range of a score.
        Entries no longer in quarantine (already requeued or discarded) are skipped.
        """
        by_shard: dict[int, list[Quarantined]] = defaultdict(list)
        for entry in entries:
            by_shard[entry.shard].append(entry)
        if not by_shard:
            return 0, []
        now_ms = int(time.time() * 1000)
        calls = [
            (
                [
                    self.key(shard, "pending"),
                    self.key(shard, "quarantine"),
                    self.key(shard, "since"),
                    self.key(shard, "qsum"),
                ],
                [now_ms, *(x for e in group for x in (e.field, e.member, e.delta, e.uncount))],
            )
            for shard, group in by_shard.items()
        ]
        replies = self._run(self._requeue, calls)
        requeued, refused = 0, cast(list[Quarantined], [])
        for group, reply in zip(by_shard.values(), replies, strict=True):
            fields = {e.field: e for e in group}
            if not (isinstance(reply, list) and reply and isinstance(reply[0], int)):
                raise UnexpectedScriptReply("REQUEUE_SCRIPT", reply)
            names = [to_str(f) for f in reply[1:]]
            if not set(names) <= set(fields):
                raise UnexpectedScriptReply("REQUEUE_SCRIPT", reply)
            requeued += reply[0]
            refused.extend(fields[name] for name in names)
        return requeued, refused

    def set_aside(self, items: Mapping[str, tuple[int, str]], origin: str) -> None:
        """Quarantine deltas that never entered Redis: ``{member: (delta, error)}``.

        For a direct write to the database that could not apply them (a value
        beyond the column's range): they are held like a flush's quarantine,
        under fields ``"<origin>|<member>"``, so writing them again after a
        crash writes the same fields and adds nothing. Like a flush's, each
        is part of its member's quarantined sum (reads count it) while it is
        exact as a score (below 2^53); a larger one is held uncounted.
        """
        at = round(time.time(), 3)
        by_shard: dict[int, list[str]] = defaultdict(list)
        for member, (delta, error) in sorted(items.items()):
            counted = abs(delta) < SCORE_LIMIT
            value = {
                "member": member,
                "delta": delta,
                "error": error[:QUARANTINE_ERROR_LIMIT],
                "at": at,
                "counted": counted,
            }
            by_shard[shard_of(member, self.shards)] += [
                f"{origin}|{member}",
                json.dumps(value),
                member,
                str(delta if counted else 0),
            ]
        calls = [
            ([self.key(shard, "quarantine"), self.key(shard, "qsum")], args)
            for shard, args in sorted(by_shard.items())
        ]
        if calls:
            replies = self._run(self._set_aside, calls)
            if not all(isinstance(n, int) for n in replies):
                raise UnexpectedScriptReply("SET_ASIDE_SCRIPT", replies)

    def discard(self, entries: Iterable[Quarantined]) -> int:
        """Delete quarantined deltas for good; returns how many were still there."""
        by_shard: dict[int, list[Quarantined]] = defaultdict(list)
        for entry in entries:
            by_shard[entry.shard].append(entry)
        if not by_shard:
            return 0
        calls = [
            (
                [self.key(shard, "quarantine"), self.key(shard, "qsum")],
                [x for e in group for x in (e.field, e.member, e.uncount)],
            )
            for shard, group in by_shard.items()
        ]
        replies = self._run(self._discard, calls)
        if not all(isinstance(n, int) for n in replies):
            raise UnexpectedScriptReply("DISCARD_SCRIPT", replies)
        return sum(replies)

    def inflight_ids(self) -> dict[int, str]:
        """Batch id in flight per shard, for shards that have one."""
        pipe = self.client.pipeline(transaction=False)
        for shard in range(self.shards):
            pipe.hget(self.key(shard, "batch"), "id")
        return {s: to_str(v) for s, v in enumerate(pipe.execute()) if v is not None}

    # -- read path ------------------------------------------------------------
    def snapshot(self, members: Iterable[str], push_ids: Iterable[PushId | str] = ()) -> Snapshot:
        """Pending, in-flight and quarantined deltas of ``members``, each shard read atomically,
        with the high-water marks of the writers of ``push_ids`` (and of their
        take-backs) in those shards: see :meth:`Snapshot.applied`."""
        groups = self.by_shard(members)
        ids = [PushId.of(p) for p in push_ids]
        names = list(dict.fromkeys(w for p in ids for w in (p.writer, p.undo().writer)))
        calls = [
            (
                [*self._shard_keys(shard), self.key(shard, "qsum")]
                + [self.writer_key(shard, w) for w in names],
                group,
            )
            for shard, group in groups.items()
        ]
        replies = self._run(self._read, calls)
        snap = Snapshot({}, {}, {}, {}, {}, {})
        for (shard, group), reply in zip(groups.items(), replies, strict=True):
            snap.gens[shard] = _int(reply[0])
            if reply[1]:
                snap.inflight_ids[shard] = to_str(reply[1])
            for i, member in enumerate(group):
                snap.pending[member] = _int(reply[2 + 3 * i])
                snap.inflight[member] = _int(reply[3 + 3 * i])
                snap.quarantined[member] = _int(reply[4 + 3 * i])
            offset = 2 + 3 * len(group)
            for i, name in enumerate(names):
                snap.hwms[(shard, name)] = _int(reply[offset + i])
        return snap

    def generations(self, shards: Iterable[int]) -> dict[int, int]:
        shards = list(shards)
        pipe = self.client.pipeline(transaction=False)
        for shard in shards:
            pipe.get(self.key(shard, "gen"))
        return {s: _int(v or 0) for s, v in zip(shards, pipe.execute(), strict=True)}
