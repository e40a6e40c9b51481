"""One bench run: own Redis prefix and users, the chosen sections, then everything removed."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import cast

from django.conf import settings
from django.test.utils import override_settings
from redis import Redis, RedisError

import counters
from counters import conf
from counters.buffer import Buffer
from counters.cluster import ClusterClient

from . import data, flush, idempotency, memory, parallel, reads, report, writers
from .child import ChildContext
from .config import BenchConfig
from .errors import BenchError


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


def _writes(config: BenchConfig, buffer: Buffer, users: list[int], progress) -> dict:
    """The writes at each writer count; the figures of the largest at the top level."""
    context = ChildContext.from_parent()
    probe = writers.RedisProbe(buffer.client)
    by_count: dict[str, dict] = {}
    tally_ops = durable_ops = 0
    for processes in config.writer_counts():
        progress(f"writes: starting {processes} writer processes")
        pool = writers.WriterPool(
            processes,
            context,
            users[: config.spread_users],
            users[0],
            timeout=60,
            send_delay_ms=config.send_delay_ms,
        )
        try:
            progress(
                "writes: measuring off / naive / tally / durable / sender "
                f"({config.send_delay_ms:g} ms), spread and hot, interleaved, {processes} writers"
            )
            result = writers.measure(pool, config.rounds, config.seconds, config.warmup, probe)
        finally:
            pool.close()
        result["processes"] = processes
        result["send_delay_ms"] = config.send_delay_ms
        result["load"] = report.load()
        by_count[str(processes)] = result
        tally_ops += pool.ops["tally"]
        durable_ops += pool.ops["durable"] + pool.ops["sender"]
    from counters.models import Outbox

    pending = pending_total(buffer)
    result = dict(by_count[str(max(config.writer_counts()))])
    result["by_processes"] = by_count
    result["tally_ops"] = tally_ops
    result["durable_ops"] = durable_ops
    result["tally_pending_deltas"] = pending
    # Every counted insert (tally and durable) is in Redis, once; no outbox row is left.
    result["outbox_rows_left"] = Outbox.objects.count()
    result["tally_deltas_match"] = (
        pending == tally_ops + durable_ops and result["outbox_rows_left"] == 0
    )
    return result


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


def _client_ready(buffer: Buffer) -> Redis | ClusterClient:
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
                for name in sections:
                    started = time.perf_counter()
                    section = SECTION_RUNNERS[name](config, buffer, users, progress)
                    section["seconds"] = round(time.perf_counter() - started, 1)
                    section["load"] = report.load()
                    results[name] = section
                    data.clear_pending(buffer)
        finally:
            progress("cleanup: bench users and their rows, ledger and epoch rows, Redis keys")
            data.delete_prefix(client, prefix)
            flush.delete_ledger_rows(batch_ids)
            data.delete_epochs(prefix)
            data.delete_bench_data(prefix)
            data.vacuum_after_delete()
    results["load_end"] = report.load()
    results["targets"] = report.targets(results)
    return results
