"""One bench run: own Redis prefix and users, the chosen sections, then everything removed."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import cast

from django.conf import settings
from django.test.utils import override_settings
from redis import RedisError

import counters

from . import (
    async_reads,
    data,
    flush,
    idempotency,
    memory,
    parallel,
    reads,
    report,
    rounds,
    trigger,
)
from .child import ChildContext
from .config import BenchConfig
from .errors import BenchError
from .internals import Buffer, RedisClient, conf
from .probes import BackendCpu, CostProbe, RedisProbe
from .watchers import Watcher, channels
from .writers import (
    MODES,
    WriterPool,
    batched_scan,
    drop_floor_keys,
    floor_address,
    floor_prefix,
    push_floor_prefix,
)


def pending_total(buffer: Buffer) -> int:
    """Sum of every pending delta in ``buffer``."""
    total = 0
    for shard in range(buffer.shards):
        pairs = cast(
            list[tuple[bytes, float]],
            buffer.client.zrange(buffer.key(shard, "pending"), 0, -1, withscores=True),
        )
        total += sum(int(score) for _, score in pairs)
    return total


def _writes_at(
    processes: int,
    config: BenchConfig,
    users: list[int],
    modes: tuple[str, ...],
    redis: RedisProbe,
    counter_trigger: trigger.CounterTrigger | None,
    progress: Callable[[str], None],
    watcher: Watcher | None = None,
) -> tuple[dict, WriterPool]:
    """The writes with ``processes`` writers: the figures, and the (closed) pool."""
    from django.db import connection

    progress(f"writes: starting {processes} writer processes")
    pool = WriterPool(
        processes,
        ChildContext.from_parent(),
        users[: config.spread_users],
        users[0],
        timeout=60,
        send_delay_ms=config.send_delay_ms,
    )
    try:
        progress(
            f"writes: measuring {' / '.join(modes)} ({config.send_delay_ms:g} ms), "
            f"spread and hot, interleaved, {processes} writers"
        )
        backend = BackendCpu(pool.backend_pids, connection.settings_dict.get("HOST") or "")
        if backend.reason is not None:
            progress(f"writes: backend CPU n/a: {backend.reason}")
        probes = rounds.Probes(CostProbe(backend, redis), counter_trigger, watcher)
        result = rounds.measure(pool, modes, config.rounds, config.seconds, config.warmup, probes)
    finally:
        pool.close()
    result["processes"] = processes
    result["send_delay_ms"] = config.send_delay_ms
    result["push_settings"] = dict(pool.push)
    result["backend_cpu_na"] = backend.reason
    result["load"] = report.load()
    return result, pool


def _writes(config: BenchConfig, buffer: Buffer, users: list[int], progress) -> dict:
    """The writes at each writer count; the figures of the largest at the top level."""
    wanted = config.write_modes()
    skipped = trigger.unsupported() if "trigger" in wanted else None
    counter_trigger = None
    if skipped is None and "trigger" in wanted:
        counter_trigger = trigger.CounterTrigger(buffer.prefix, users[: config.spread_users])
        for name in trigger.drop_leftovers():
            progress(f"writes: dropped trigger {name}, left by a bench killed during its run")
    elif skipped is not None:
        progress(f"writes: {skipped}")
    floor = floor_address(buffer.client) is not None
    watcher = _watcher(config, buffer, users) if "watched" in wanted else None
    modes = tuple(
        m
        for m in wanted
        if (m != "trigger" or counter_trigger is not None)
        and (not m.startswith("floor") or floor)
        and (m != "watched" or watcher is not None)
    )
    if not floor and any(m.startswith("floor") for m in wanted):
        progress("writes: no floor mode: it needs a plain Redis (TCP or a Unix socket)")
    if "watched" in wanted and watcher is None:
        progress("writes: no watched mode: its watcher needs one Redis server, not a cluster")
    if not modes:
        raise BenchError(f"none of the write modes {','.join(wanted)} can run here")
    redis = RedisProbe(buffer.client)
    by_count: dict[str, dict] = {}
    ops = dict.fromkeys(MODES, 0)
    for processes in config.writer_counts():
        figures, pool = _writes_at(
            processes, config, users, modes, redis, counter_trigger, progress, watcher
        )
        by_count[str(processes)] = figures
        ops = {mode: n + pool.ops[mode] for mode, n in ops.items()}
    result = dict(by_count[str(max(config.writer_counts()))])
    result["by_processes"] = by_count
    result["modes"] = list(modes)
    _checks(result, buffer, ops, counter_trigger, skipped)
    if watcher is not None and "watched" in modes:
        # every insert of the mode was watched: its watcher got one message per insert
        result["watched_ops"] = ops["watched"]
        result["watched_messages"] = watcher.messages
        if float(conf.get("COUNTERS_SEND_DELAY_MS") or 0) > 0:
            result["watched_merged"] = True  # the sender merges a key's commits: fewer messages
    if floor and "floor_push" in modes:
        _push_floor_check(result, buffer, ops["floor_push"])
    if floor and ("floor" in modes or "floor_durable" in modes):
        _floor_check(result, buffer, ops["floor"] + ops["floor_durable"])
    return result


def _watcher(config: BenchConfig, buffer: Buffer, users: list[int]) -> Watcher | None:
    """The watched mode's watcher of every key the writers write; None on a Redis Cluster."""
    from notifications.apps import UNREAD_COUNTER

    from .internals import ClusterClient

    if isinstance(buffer.client, ClusterClient):
        return None
    keys = channels(buffer.prefix, buffer.shards, UNREAD_COUNTER, users[: config.spread_users])
    return Watcher(conf.redis_url(), buffer.client, keys)


def _push_floor_check(result: dict, buffer: Buffer, ops: int) -> None:
    """Every push of the ``floor_push`` mode applied: its pending sets add up to its inserts."""
    client = buffer.client
    sets = [
        k
        for batch in batched_scan(client, f"{push_floor_prefix(buffer.prefix)}*:pending")
        for k in batch
    ]
    added = sum(score for key in sets for _, score in client.zscan_iter(key))
    result["floor_push_ops"] = ops
    result["floor_push_sent_match"] = added == ops


def _floor_check(result: dict, buffer: Buffer, ops: int) -> None:
    """Every insert of the floor mode sent its command: their keys add up to its inserts."""
    keys = [
        k for batch in batched_scan(buffer.client, f"{floor_prefix(buffer.prefix)}*") for k in batch
    ]
    sent = sum(int(v or 0) for v in buffer.client.mget(keys)) if keys else 0
    result["floor_ops"] = ops
    result["floor_sent_match"] = sent == ops
    drop_floor_keys(buffer.client, buffer.prefix)


def _checks(
    result: dict,
    buffer: Buffer,
    ops: dict[str, int],
    counter_trigger: trigger.CounterTrigger | None,
    skipped: str | None,
) -> None:
    """Every counted insert was counted once: in Redis (tally, durable, sender, waited), every
    outbox row's push applied (what the next flush deletes); by the trigger, each user's row
    grew by that user's unread inserts."""
    from counters.models import Outbox

    from .internals import clear_landed

    pending = pending_total(buffer)
    result["tally_ops"] = sum(
        ops[m] for m in ("tally", "per_commit", "waited", "batched", "live", "watched")
    )
    result["durable_ops"] = ops["durable"] + ops["sender"]
    result["tally_pending_deltas"] = pending
    cleared = 0
    while batch := clear_landed(buffer, limit=10_000):
        cleared += batch
    result["outbox_rows_applied"] = cleared
    result["outbox_rows_left"] = Outbox.objects.count()
    result["tally_deltas_match"] = (
        pending == result["tally_ops"] + result["durable_ops"]
        and cleared == ops["durable"]  # one row per durable insert, its push applied
        and result["outbox_rows_left"] == 0
    )
    if counter_trigger is None:
        if skipped is not None:
            result["trigger_skipped"] = skipped
        return
    result["trigger_ops"] = ops["trigger"]
    result["trigger_counted_rows"] = counter_trigger.rows
    result["trigger_users_off"] = counter_trigger.users_off
    result["trigger_counts_exact"] = (
        counter_trigger.users_off == 0 and counter_trigger.rows == ops["trigger"] > 0
    )
    result["trigger_left_installed"] = counter_trigger.installed()


def _flush(config: BenchConfig, buffer: Buffer, users: list[int], progress) -> dict:
    progress(f"flush: {config.flush_keys:,} pending keys, real flush against raw SQL")
    return flush.measure(buffer, users[: config.flush_keys], config.flush_rounds)


def _parallel(config: BenchConfig, buffer: Buffer, users: list[int], progress) -> dict:
    workers = ", ".join(map(str, config.parallel_workers))
    progress(
        f"parallel: {config.parallel_keys:,} pending keys flushed by {workers} flusher "
        "processes on disjoint shards"
    )
    return parallel.measure(
        buffer,
        ChildContext.from_parent(),
        users[: config.parallel_keys],
        config.parallel_workers,
        config.parallel_rounds,
    )


def _reads(config: BenchConfig, buffer: Buffer, users: list[int], progress) -> dict:
    progress(
        f"reads: inserting {config.read_notifications:,} notifications, "
        f"{config.read_unread:,} unread for one user"
    )
    reader = reads.prepare(buffer.prefix, config.read_notifications, config.read_unread)
    progress("reads: get_count against COUNT(*)")
    return reads.measure(reader, config.read_notifications, config.read_samples)


def _async(config: BenchConfig, buffer: Buffer, users: list[int], progress) -> dict:
    tasks = ", ".join(map(str, config.async_concurrency))
    progress(
        f"async: aget_values (a thread hop) against a native asyncio read, {tasks} tasks at once"
    )
    return async_reads.measure(
        buffer,
        users[: config.async_keys],
        config.async_concurrency,
        config.async_reads,
        config.async_rounds,
    )


def _memory(config: BenchConfig, buffer: Buffer, users: list[int], progress) -> dict:
    sizes = [config.memory_small, config.memory_large]
    progress(f"memory: flusher processes draining {sizes[0]:,} and {sizes[1]:,} pending keys")
    return memory.measure(buffer, ChildContext.from_parent(), users, sizes)


def _idempotency(config: BenchConfig, buffer: Buffer, users: list[int], progress) -> dict:
    n, threads = config.idem_pushes, config.idem_threads
    progress(
        f"idempotency: {n:,} and {3 * n:,} pushes from {threads} threads, per-push markers "
        "(the old scheme) against writer marks"
    )
    return idempotency.measure(buffer.client, buffer.prefix, buffer.shards, n, threads)


SECTION_RUNNERS: dict[str, Callable[..., dict]] = {
    "writes": _writes,
    "flush": _flush,
    "parallel": _parallel,
    "reads": _reads,
    "async": _async,
    "memory": _memory,
    "idempotency": _idempotency,
}


def _database_ready() -> None:
    """The bench writes through the models: their tables must be migrated."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if plan:
        names = ", ".join(f"{m.app_label}.{m.name}" for m, _ in plan[:3])
        more = f" and {len(plan) - 3} more" if len(plan) > 3 else ""
        raise BenchError(f"unapplied migrations ({names}{more}): run manage.py migrate first")


def _client_ready(buffer: Buffer) -> RedisClient:
    try:
        buffer.client.ping()
    except RedisError as exc:
        raise BenchError(f"Redis unreachable at {conf.redis_url()}: {exc}") from exc
    return buffer.client


def redis_settings(redis_url: str | None, cluster: bool) -> dict[str, object]:
    """The ``COUNTERS_*`` settings a run overrides for ``--redis-url`` and ``--cluster``."""
    overrides: dict[str, object] = {}
    if redis_url:
        overrides["COUNTERS_REDIS_URL"] = redis_url
    if cluster:
        if "COUNTERS_REDIS_CLUSTER" not in conf.SETTINGS:
            raise BenchError(
                "--cluster needs Redis Cluster support (the COUNTERS_REDIS_CLUSTER setting), "
                "which this version of counters does not have"
            )
        overrides["COUNTERS_REDIS_CLUSTER"] = True
    return overrides


def run(
    config: BenchConfig,
    sections: tuple[str, ...],
    progress: Callable[[str], None],
    redis_url: str | None = None,
    cluster: bool = False,
) -> dict:
    """Run ``sections`` under a fresh key prefix and user prefix; the results as a dict.

    ``redis_url`` replaces ``COUNTERS_REDIS_URL`` for the run (and its child
    processes); ``cluster`` turns ``COUNTERS_REDIS_CLUSTER`` on.
    """
    prefix = f"bench-{secrets.token_hex(6)}"
    overrides = redis_settings(redis_url, cluster)
    with override_settings(COUNTERS_KEY_PREFIX=prefix, **overrides):
        buffer = counters.get_buffer()
        client = _client_ready(buffer)
        _database_ready()
        results: dict = {
            "key_prefix": prefix,
            "machine": report.machine(client),
            "redis": {"nodes": report.redis_nodes(conf.redis_url()), "cluster": cluster},
            "config": asdict(config),
            "debug": settings.DEBUG,
            "load_start": report.load(),
        }
        try:
            with flush.recorded_batch_ids() as batch_ids:
                users_needed = config.users_needed(sections)
                progress(f"setup: {users_needed:,} bench users {prefix}-u* with counter rows")
                users = data.create_users(prefix, users_needed)
                data.create_counters(prefix)
                data.analyze_after_setup()
                for name in sections:
                    started = time.perf_counter()
                    section = SECTION_RUNNERS[name](config, buffer, users, progress)
                    section["seconds"] = round(time.perf_counter() - started, 1)
                    section["load"] = report.load()
                    results[name] = section
                    data.clear_pending(buffer)
        finally:
            progress(
                "cleanup: Redis keys, the trigger if a failure left it, bench users and "
                "their rows, ledger and epoch rows"
            )
            data.delete_prefix(client, prefix)
            trigger.remove(prefix)
            flush.delete_ledger_rows(batch_ids)
            data.delete_epochs(prefix)
            data.delete_bench_data(prefix)
            data.vacuum_after_delete()
    results["load_end"] = report.load()
    results["targets"] = report.targets(results)
    return results
