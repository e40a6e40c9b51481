"""Idempotency memory: the Redis keys and bytes deduplication costs, old scheme against new.

The old scheme (a marker key per push and shard, kept PUSH_MARKER_TTL_MS) is
reproduced here as a reference: its PUSH_SCRIPT, unchanged. The new scheme is
the real :meth:`counters.buffer.store.Buffer.push` with push ids from
:mod:`counters.buffer.pushids` (both through :mod:`benchmarks.internals`). Both run
side by side in one process, on prefixes of their own under the run's prefix, with
the same pushes: ``threads`` threads, one delta each to one of ``members``
members. Each run is measured for ``n`` and ``3n`` pushes: the old cost grows with
the pushes, the new one stays flat.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import BenchError
from .internals import PUSH_MARKER_TTL_MS, Buffer, RedisClient, pushids

#: The old PUSH_SCRIPT, as it was before writer ids: the reference implementation.
OLD_PUSH_SCRIPT = """
local pending, marker, since = KEYS[1], KEYS[2], KEYS[3]
local ttl, sent_at, max_age = ARGV[1], ARGV[2], ARGV[3]
local limit = 9007199254740992
local now = redis.call('TIME')
if (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)) - tonumber(sent_at)
    > tonumber(max_age) then
  return 2
end
if redis.call('EXISTS', marker) == 1 then return 0 end
local refused = {3}
for i = 4, #ARGV, 2 do
  local sum = tonumber(redis.call('ZSCORE', pending, ARGV[i]) or '0') + tonumber(ARGV[i + 1])
  if sum >= limit or sum <= -limit then refused[#refused + 1] = ARGV[i] end
end
if #refused > 1 then return refused end
redis.call('SET', marker, '1', 'PX', ttl)
redis.call('SET', since, sent_at, 'NX')
for i = 4, #ARGV, 2 do
  if tonumber(redis.call('ZINCRBY', pending, ARGV[i + 1], ARGV[i])) == 0 then
    redis.call('ZREM', pending, ARGV[i])
  end
end
return 1
"""

#: The old PUSH_MAX_AGE_MS.
OLD_MAX_AGE_MS = 30_000


class OldScheme:
    """The per-push marker keys: ``<prefix>:{sN}:push:<uuid>`` per push and shard."""

    name = "old"

    def __init__(self, client: RedisClient, prefix: str, shards: int) -> None:
        self.buffer = Buffer(client, prefix, shards)  # its keys and shard function
        self.script = client.register_script(OLD_PUSH_SCRIPT)
        self.idempotency_match = "push:*"
        self._ids = iter(range(1, 1 << 62))
        self._lock = threading.Lock()

    def push(self, member: str) -> None:
        with self._lock:
            push_id = f"{next(self._ids):032x}"  # as long as the old uuid4().hex ids
        shard = self.buffer.shard_of(member)
        keys = [
            self.buffer.key(shard, "pending"),
            self.buffer.key(shard, f"push:{push_id}"),
            self.buffer.key(shard, "since"),
        ]
        now_ms = int(time.time() * 1000)
        reply = self.script(keys=keys, args=[PUSH_MARKER_TTL_MS, now_ms, OLD_MAX_AGE_MS, member, 1])
        if reply != 1:
            raise BenchError(f"old push refused: {reply!r}")


class NewScheme:
    """Writer ids and sequence numbers: the real Buffer.push."""

    name = "new"

    def __init__(self, client: RedisClient, prefix: str, shards: int) -> None:
        self.buffer = Buffer(client, prefix, shards)
        self.idempotency_match = "w:*"
        self.writers: set[str] = set()
        self._lock = threading.Lock()

    def push(self, member: str) -> None:
        push_id = pushids.allocate()
        try:
            changed = self.buffer.push({member: 1}, push_id)
        except BaseException:
            pushids.retire(push_id)
            raise
        pushids.release(push_id)
        if not changed:
            raise BenchError(f"new push {push_id} refused")
        with self._lock:
            self.writers.add(push_id.writer)


def _used_memory(client: RedisClient) -> int:
    """INFO memory used_memory, summed over the nodes of a cluster."""
    info = client.info("memory")
    if "used_memory" in info:
        return int(info["used_memory"])
    return sum(int(v["used_memory"]) for v in info.values() if isinstance(v, dict))


def _keys(client: RedisClient, buffer: Buffer, name: str) -> list[str]:
    return [
        k.decode() if isinstance(k, bytes) else k
        for shard in range(buffer.shards)
        for k in client.scan_iter(match=buffer.key(shard, name), count=1000)
    ]


def _bytes(client: RedisClient, keys: list[str]) -> int:
    total = 0
    for i in range(0, len(keys), 1000):
        pipe = client.pipeline(transaction=False)
        for key in keys[i : i + 1000]:
            pipe.memory_usage(key, samples=0)
        total += sum(int(n or 0) for n in pipe.execute())
    return total


def _delete(client: RedisClient, keys: list[str]) -> None:
    for i in range(0, len(keys), 500):
        pipe = client.pipeline(transaction=False)
        for key in keys[i : i + 500]:
            pipe.delete(key)
        pipe.execute()


def _drive(push: Callable[[str], None], pushes: int, threads: int, members: int) -> float:
    """``pushes`` pushes from ``threads`` threads; the seconds they took."""
    errors: list[BaseException] = []
    share = [pushes // threads + (1 if t < pushes % threads else 0) for t in range(threads)]

    def work(t: int) -> None:
        try:
            for i in range(share[t]):
                push(f"unread:{(i * threads + t) % members}")
        except BaseException as exc:
            errors.append(exc)

    started = time.perf_counter()
    pool = [
        threading.Thread(target=work, args=(t,), name=f"bench-idem-{t}") for t in range(threads)
    ]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise BenchError(f"idempotency push failed: {type(errors[0]).__name__}: {errors[0]}")
    return seconds


def _run(scheme: OldScheme | NewScheme, pushes: int, threads: int, members: int) -> dict[str, Any]:
    """One measured run of ``scheme`` from an empty prefix; its keys are deleted after."""
    client = scheme.buffer.client
    before = _used_memory(client)
    seconds = _drive(scheme.push, pushes, threads, members)
    used = _used_memory(client) - before
    marks = _keys(client, scheme.buffer, scheme.idempotency_match)
    every = _keys(client, scheme.buffer, "*")
    pending = sum(
        int(client.zcard(scheme.buffer.key(s, "pending"))) for s in range(scheme.buffer.shards)
    )
    result: dict[str, Any] = {
        "pushes": pushes,
        "seconds": round(seconds, 2),
        "pushes_per_s": round(pushes / seconds) if seconds else 0,
        "keys_added": len(every),
        "idempotency_keys": len(marks),
        "idempotency_bytes": _bytes(client, marks),
        "bytes_added": _bytes(client, every),
        "used_memory_delta": used,
        "pending_members": pending,
    }
    result["bytes_per_push"] = round(result["idempotency_bytes"] / pushes, 1)
    if isinstance(scheme, NewScheme):
        result["writers"] = len(scheme.writers)
    held = _used_memory(client)
    _delete(client, every)
    # What deleting the run's keys gave back: their whole footprint, allocator included,
    # over a moment short enough for the rest of a shared server to change little.
    result["used_memory_freed"] = held - _used_memory(client)
    if seconds * 1000 > PUSH_MARKER_TTL_MS:
        result["note"] = "ran longer than the marker TTL: early markers had expired"
    return result


def measure(
    client: RedisClient,
    prefix: str,
    shards: int,
    pushes: int,
    threads: int = 4,
    members: int = 1024,
) -> dict[str, Any]:
    """Both schemes at ``pushes`` and ``3 * pushes``, interleaved old/new at each size."""
    runs: dict[str, dict[str, Any]] = {}
    for size in (pushes, 3 * pushes):
        runs[str(size)] = {}
        for scheme in (
            OldScheme(client, f"{prefix}:idem-old", shards),
            NewScheme(client, f"{prefix}:idem-new", shards),
        ):
            runs[str(size)][scheme.name] = _run(scheme, size, threads, members)
    base, triple = runs[str(pushes)], runs[str(3 * pushes)]
    return {
        "pushes": pushes,
        "threads": threads,
        "shards": shards,
        "members": members,
        "marker_ttl_s": PUSH_MARKER_TTL_MS / 1000,
        "runs": runs,
        "new_keys_limit": shards * threads,
        "new_flat": triple["new"]["idempotency_keys"] <= shards * threads
        and base["new"]["idempotency_keys"] <= shards * threads,
        "old_growth": round(
            triple["old"]["idempotency_keys"] / max(1, base["old"]["idempotency_keys"]), 2
        ),
        "new_growth": round(
            triple["new"]["idempotency_keys"] / max(1, base["new"]["idempotency_keys"]), 2
        ),
    }
