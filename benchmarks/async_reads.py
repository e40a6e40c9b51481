"""Async reads: the thread hop ``counters.aget_values`` is, against a native asyncio read.

Two designs of an async exact read were measured, and the hop was kept:

``hop``
    ``counters.aget_values``: the sync read in a thread (``sync_to_async``,
    thread-sensitive), as Django's own async ORM methods run their queries.
``native``
    The other design, at its best: the Redis snapshot and the generation
    check with redis-py's asyncio client in the event loop, the rows (one
    SQL statement) in a thread, since Django has no async database I/O. It is
    the optimistic path only: what the real read also does (hold the
    process's sender still, take the shards' leases when flushes keep
    racing it, a Redis Cluster) would cost it more, not less.

Each design runs ``concurrency`` tasks at once, each in a
``ThreadSensitiveContext`` of its own as Django's ASGI handler gives each
request, all reading the counters of the same keys; the figures are reads per
second (wall clock) and the process CPU per read (every thread), the median
of the rounds. Both designs must give what the sync ``get_values`` gives.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.db import connections
from redis import asyncio as aioredis

import counters
from notifications.apps import UNREAD_COUNTER

from .errors import BenchError
from .internals import Buffer, conf, int_reply, read_rows, sender, to_str, unsent

Read = Callable[[list[int]], Awaitable[dict[Any, int]]]
#: Readings of the native design before it gives up (the bench runs no flush meanwhile).
READINGS = 5


class NativeRead:
    """The optimistic exact read with Redis I/O in the event loop (one Redis, not a cluster)."""

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer
        self.client = aioredis.Redis.from_url(conf.redis_url(), max_connections=256)

    async def __call__(self, keys: list[int]) -> dict[Any, int]:
        spec, buffer = counters.get_spec(UNREAD_COUNTER), self.buffer
        normal = {key: spec.normalize(key) for key in keys}
        members = {spec.member(value): value for value in normal.values()}
        groups = buffer.by_shard(members)
        for _ in range(READINGS):
            pipe = self.client.pipeline(transaction=False)
            for shard, group in groups.items():
                shard_keys = [*buffer._shard_keys(shard), buffer.key(shard, "qsum")]
                sha = buffer._read.sha
                pipe.execute_command("EVALSHA", sha, len(shard_keys), *shard_keys, *group)
            gens, ids, buffered = self._parse(groups, await pipe.execute())
            rows, own = await sync_to_async(_rows_and_own)(spec, members, set(ids.values()))
            pipe = self.client.pipeline(transaction=False)
            for shard in gens:
                pipe.get(buffer.key(shard, "gen"))
            again = [int_reply(v or 0) for v in await pipe.execute()]
            if again == list(gens.values()):
                break
        else:
            raise BenchError(f"no consistent native reading of {keys} in {READINGS} tries")
        values = {}
        for key, value in normal.items():
            member = spec.member(value)
            pending, inflight, quarantined = buffered[member]
            if ids.get(buffer.shard_of(member)) in rows.applied:
                inflight = 0
            total = rows.stored.get(value, 0) + pending + inflight + quarantined
            total += own.get(member, 0)
            # as the sync read's clamp shows it (which also queues the key for repair)
            values[key] = max(0, total) if spec.non_negative else total
        return values

    @staticmethod
    def _parse(groups: dict[int, list[str]], replies: list) -> tuple[dict, dict, dict]:
        gens: dict[int, int] = {}
        ids: dict[int, str] = {}
        buffered: dict[str, tuple[int, int, int]] = {}
        for (shard, group), reply in zip(groups.items(), replies, strict=True):
            gens[shard] = int_reply(reply[0])
            if reply[1]:
                ids[shard] = to_str(reply[1])
            for i, member in enumerate(group):
                buffered[member] = tuple(int_reply(r) for r in reply[2 + 3 * i : 5 + 3 * i])  # type: ignore[assignment]
        return gens, ids, buffered

    async def close(self) -> None:
        await self.client.aclose()


def _rows_and_own(spec: Any, members: dict[str, Any], batch_ids: set[str]) -> tuple[Any, dict]:
    """The rows' statement, and what the transaction of this thread has not sent."""
    rows = read_rows(spec, list(members.values()), batch_ids, "default")
    return rows, unsent(members, "default")


async def hop(keys: list[int]) -> dict[Any, int]:
    return await counters.aget_values(UNREAD_COUNTER, keys)


async def _run(read: Read, keys: list[int], concurrency: int, reads: int) -> tuple[float, float]:
    """(reads per second, CPU microseconds per read) of ``concurrency`` tasks at once."""
    per_task = max(1, reads // concurrency)

    async def task(i: int) -> None:
        async with ThreadSensitiveContext():
            for j in range(per_task):
                await read([keys[(i + j) % len(keys)]])
            await sync_to_async(connections.close_all)()

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(task(i) for i in range(concurrency)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    done = per_task * concurrency
    return done / wall, cpu / done * 1e6


async def _measure(
    designs: dict[str, Read], keys: list[int], concurrency: tuple[int, ...], reads: int, rounds: int
) -> dict[str, dict[str, dict[str, float]]]:
    samples: dict[str, dict[int, list[tuple[float, float]]]] = {
        name: {c: [] for c in concurrency} for name in designs
    }
    for _ in range(rounds):  # interleaved, so a change of load touches every design alike
        for c in concurrency:
            for name, read in designs.items():
                samples[name][c].append(await _run(read, keys, c, reads))
    return {
        name: {
            str(c): {
                "reads_per_s": round(statistics.median(r for r, _ in runs)),
                "cpu_us_per_read": round(statistics.median(u for _, u in runs)),
            }
            for c, runs in by_c.items()
        }
        for name, by_c in samples.items()
    }


def measure(
    buffer: Buffer, keys: list[int], concurrency: tuple[int, ...], reads: int, rounds: int
) -> dict:
    """Both designs on ``keys`` (some with buffered deltas); exact against the sync read."""
    for key in keys[::2]:
        counters.add(UNREAD_COUNTER, key, 1)
    sender.push_queued()  # the native read sees Redis alone, not this process's queue
    expected = counters.get_values(UNREAD_COUNTER, keys)

    async def run() -> tuple[dict, bool]:
        # redis-py's asyncio client of one Redis: on a cluster, the hop alone is measured.
        native = None if conf.redis_cluster() else NativeRead(buffer)
        try:
            designs: dict[str, Read] = {"hop": hop}
            if native is not None:
                designs["native"] = native
            exact = True
            for read in designs.values():
                async with ThreadSensitiveContext():
                    exact &= all([await read([k]) == {k: expected[k]} for k in keys])
                    await sync_to_async(connections.close_all)()
            return await _measure(designs, keys, concurrency, reads, rounds), exact
        finally:
            if native is not None:
                await native.close()

    figures, exact = asyncio.run(run())
    return {
        "keys": len(keys),
        "reads": reads,
        "rounds": rounds,
        "exact": exact,
        "designs": figures,
        "cluster": conf.redis_cluster(),
    }
