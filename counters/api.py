"""The Django layer: settings → Buffer, the write path, reads, and flush entry points."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from django.core.signals import setting_changed
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections, transaction
from django.dispatch import receiver
from django.utils import timezone
from redis import Redis, RedisError
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import conf, outbox, repair
from .buffer import Buffer
from .exceptions import BufferUnavailable, FlushFailed, RebuildRunning, StalePush
from .lease import Lease
from .registry import get_spec

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_clients: dict[tuple[str, float], Redis] = {}
_buffers: dict[tuple[str, float, str, int], Buffer] = {}

#: Times the write path sent deltas straight to the DB because Redis failed (this process).
fallback_count = 0


def get_client(url: str | None = None, timeout: float | None = None) -> Redis:
    """A shared client for ``url`` (default: ``COUNTERS_REDIS_URL``).

    redis-py's own retries are off: every caller here decides itself whether a
    repeat is safe, and the write path must fall back quickly when Redis is down.
    """
    url = url or conf.redis_url()
    timeout = conf.socket_timeout() if timeout is None else timeout
    key = (url, timeout)
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                client = _clients[key] = Redis.from_url(
                    url,
                    socket_timeout=timeout,
                    socket_connect_timeout=timeout,
                    retry=Retry(NoBackoff(), 0),
                    health_check_interval=30,
                )
    return client


_current: Buffer | None = None


def get_buffer() -> Buffer:
    """The Buffer configured by the ``COUNTERS_*`` settings.

    Cached for the hot path; a changed setting (``setting_changed``, as sent by
    ``override_settings``) makes the next call read the settings again.
    """
    global _current
    buffer = _current
    if buffer is not None:
        return buffer
    url, timeout = conf.redis_url(), conf.socket_timeout()
    prefix, shards = conf.key_prefix(), conf.shards()
    key = (url, timeout, prefix, shards)
    buffer = _buffers.get(key)
    if buffer is None:
        buffer = _buffers[key] = Buffer(get_client(url, timeout), prefix, shards)
    _current = buffer
    return buffer


@receiver(setting_changed)
def _forget_buffer(setting: str, **kwargs: Any) -> None:
    global _current
    if setting.startswith("COUNTERS_") or setting == "REDIS_URL":
        _current = None


# -- write path ---------------------------------------------------------------


def add(name: str, key: Any, delta: int = 1, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Add ``delta`` to counter ``name`` at ``key`` once the current transaction commits."""
    if delta:
        add_many(name, {key: delta}, using=using)


def add_many(name: str, deltas: Mapping[Any, int], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Add several deltas ({key: delta}) to counter ``name`` after commit."""
    spec = get_spec(name)
    outbox.record({spec.member(k): d for k, d in deltas.items() if d}, using, send)


def send(deltas: Mapping[str, int], using: str) -> None:
    """Push committed deltas to Redis; if Redis fails, apply them to the DB directly.

    Never raises: it runs after COMMIT, where the request has already succeeded.
    """
    push_id = uuid.uuid4().hex
    buffer = get_buffer()
    maybe_sent = False
    for attempt in (1, 2):
        try:
            buffer.push(deltas, push_id)
            return
        except (RedisError, StalePush) as exc:
            # The push is idempotent per push_id, so one repeat is safe even if
            # the first attempt ran and only its reply was lost. A failure after
            # the command left (a timeout, a reset) may still deliver it later:
            # the direct write then stays unsettled until a flush fences it.
            maybe_sent = maybe_sent or "connecting" not in str(exc)
            if attempt == 2:
                logger.warning(
                    "Redis push failed (%s); writing %s deltas to the DB", exc, len(deltas)
                )
    write_direct(deltas, using, push_id=push_id, unsettled=maybe_sent)


def write_direct(
    deltas: Mapping[str, int],
    using: str,
    *,
    push_id: str | None = None,
    unsettled: bool = False,
    attempts: int = 3,
) -> None:
    """Apply deltas to the DB now, recorded in the ledger as a fallback batch."""
    global fallback_count
    from .apply import apply_deltas
    from .models import FlushBatch

    for attempt in range(1, attempts + 1):
        try:
            with transaction.atomic(using=using):
                applied = apply_deltas(deltas, using)
                FlushBatch.objects.using(using).create(
                    batch_id=f"{FALLBACK_PREFIX}{push_id or uuid.uuid4().hex}",
                    kind=FlushBatch.Kind.FALLBACK,
                    keys=applied.keys,
                    deltas=applied.deltas,
                    dropped=applied.dropped,
                    unsettled=dict(deltas) if unsettled else None,
                )
            fallback_count += 1
            return
        except OperationalError:
            # Deadlock or lock timeout against a concurrent flush: try again.
            if attempt == attempts:
                logger.exception(
                    "could not write %s deltas to the DB: %r", len(deltas), dict(deltas)
                )
                return
            time.sleep(0.05 * attempt)
        except Exception:
            logger.exception("could not write %s deltas to the DB: %r", len(deltas), dict(deltas))
            return


FALLBACK_PREFIX = "fallback-"


def settle_fallbacks(buffer: Buffer, using: str = DEFAULT_DB_ALIAS, limit: int = 500) -> int:
    """Fence the pushes of direct writes that may still arrive; undo any that did.

    A push that timed out can reach Redis later (a healed partition, a stalled
    server). Fencing sets its push marker, so it can never apply from now on;
    if the marker shows it already did, the same deltas were counted by the
    direct write too, and a compensating push (idempotent: a derived id)
    takes them back. Returns the number of compensated writes.
    """
    from .buffer import PUSH_MARKER_TTL_MS
    from .models import FlushBatch

    compensated = 0
    rows = FlushBatch.objects.using(using).filter(
        kind=FlushBatch.Kind.FALLBACK, unsettled__isnull=False
    )
    for row in rows.order_by("applied_at")[:limit]:
        push_id = row.batch_id.removeprefix(FALLBACK_PREFIX)
        deltas: dict[str, int] = row.unsettled
        landed = buffer.fence(deltas, push_id)
        if landed:
            undo = {m: -d for m, d in deltas.items() if buffer.shard_of(m) in landed}
            buffer.push(undo, f"{push_id}-undo")
            compensated += 1
            logger.warning(
                "push %s timed out but reached Redis later; took back its %s deltas",
                push_id,
                len(undo),
            )
        age_ms = (timezone.now() - row.applied_at).total_seconds() * 1000
        if age_ms > PUSH_MARKER_TTL_MS:
            logger.warning(
                "direct write %s was fenced %.0fs late; if its push arrived meanwhile it is "
                "counted twice: run a rebuild",
                row.batch_id,
                age_ms / 1000,
            )
        FlushBatch.objects.using(using).filter(pk=row.pk).update(unsettled=None)
    return compensated


# -- read path ----------------------------------------------------------------


def _non_negative(get_values):
    """Post-process ``get_values``: a ``non_negative`` counter reads 0, never below."""

    @functools.wraps(get_values)
    def clamped(name: str, keys: Iterable[Any], *, using: str = DEFAULT_DB_ALIAS) -> dict:
        return repair.clamp(get_spec(name), get_values(name, keys, using=using), get_buffer)

    return clamped


@_non_negative
def get_values(name: str, keys: Iterable[Any], *, using: str = DEFAULT_DB_ALIAS) -> dict[Any, int]:
    """Exact current values: stored row + pending + in-flight unless already applied.

    If Redis is unreachable the stored rows are returned: changes made while
    Redis is down are written to the rows directly, so they are the best answer
    there is, and a page must not fail because of the buffer.
    """
    keys = list(dict.fromkeys(keys))
    try:
        parts = get_parts(name, keys, using=using)
    except BufferUnavailable as exc:
        logger.warning("%s; reading %s from the DB only", exc, name)
        stored, _ = _read_rows(get_spec(name), keys, set(), using)
        return {key: stored.get(key, 0) for key in keys}
    return {key: stored + buffered for key, (stored, buffered) in parts.items()}


def get_parts(
    name: str, keys: Iterable[Any], *, using: str = DEFAULT_DB_ALIAS
) -> dict[Any, tuple[int, int]]:
    """(stored, buffered) per key; their sum is the exact value.

    Redis is read before and after the DB; if a batch was moved or acknowledged
    in between, the read is repeated, so a delta is never counted twice or
    missed. Raises :class:`BufferUnavailable` when Redis cannot be reached.
    """
    spec = get_spec(name)
    keys = list(dict.fromkeys(keys))
    if not keys:
        return {}
    members = {spec.member(k): k for k in keys}
    buffer = get_buffer()
    try:
        for _ in range(5):
            snap = buffer.snapshot(members)
            stored, applied = _read_rows(spec, keys, set(snap.inflight_ids.values()), using)
            if buffer.generations(snap.gens) == snap.gens:
                break
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_url(), exc) from exc
    parts = {}
    for member, key in members.items():
        shard = buffer.shard_of(member)
        inflight = 0 if snap.inflight_ids.get(shard) in applied else snap.inflight[member]
        parts[key] = (stored.get(key, 0), snap.pending[member] + inflight)
    return parts


def get_value(name: str, key: Any, *, using: str = DEFAULT_DB_ALIAS) -> int:
    return get_values(name, [key], using=using)[key]


def _read_rows(spec, keys: list, batch_ids: set[str], using: str) -> tuple[dict, set[str]]:
    """Stored values of ``keys`` and which of ``batch_ids`` are applied, in one statement.

    One statement sees one snapshot, so the value and the ledger agree.
    """
    from .models import FlushBatch

    model = spec.model
    conn = connections[using]
    qn = conn.ops.quote_name
    table = qn(model._meta.db_table)
    key_col = qn(spec.key_model_field.column)
    value_col = qn(model._meta.get_field(spec.value_field).column)
    ledger = qn(FlushBatch._meta.db_table)
    ledger_pk = qn(FlushBatch._meta.pk.column)
    ids = sorted(batch_ids)
    rows_sql = (
        f"SELECT {key_col}, {value_col}, NULL FROM {table} "
        f"WHERE {key_col} IN ({', '.join(['%s'] * len(keys))})"
    )
    params: list = [spec.key_model_field.get_db_prep_value(k, conn) for k in keys]
    if ids:
        rows_sql += (
            f" UNION ALL SELECT NULL, NULL, {ledger_pk} FROM {ledger} "
            f"WHERE {ledger_pk} IN ({', '.join(['%s'] * len(ids))})"
        )
        params += ids
    stored: dict = {}
    applied: set[str] = set()
    with conn.cursor() as cursor:
        cursor.execute(rows_sql, params)
        for key, value, batch_id in cursor.fetchall():
            if batch_id is None:
                stored[spec.to_key(key)] = int(value)
            else:
                applied.add(batch_id)
    return stored, applied


# -- flush ----------------------------------------------------------------------


def flush(*, using: str = DEFAULT_DB_ALIAS, time_budget: float | None = None):
    """Flush every shard once with the configured settings; returns a FlushResult.

    Then rebuilds the keys queued by reads below zero, and, while Redis data
    loss is not repaired yet ("rebuild needed") and ``COUNTERS_AUTO_REBUILD``
    is on, runs the full rebuild. ``result.rebuild_needed_since`` tells if
    counters are still wrong. Records the result for ``counters_status``.
    Raises :class:`BufferUnavailable` when Redis cannot be reached and
    :class:`FlushFailed` (carrying the result) when some shards failed.
    """
    from .flusher import flush as run_flush

    buffer = get_buffer()
    try:
        # Fence late pushes first, so that what they added and what takes it
        # back cancel out in the pending set before this flush moves it.
        compensated = settle_fallbacks(buffer, using)
        result = run_flush(
            buffer,
            using=using,
            batch_size=conf.batch_size(),
            time_budget=conf.flush_time_budget() if time_budget is None else time_budget,
            lease_timeout=conf.lease_timeout(),
            retention=conf.ledger_retention(),
        )
        result.compensated = compensated
        result.repaired = repair_queued(buffer, using)
        result.rebuild_needed_since = _needed_since(buffer, using)
        if result.rebuild_needed_since and conf.auto_rebuild():
            record_flush(buffer, result)  # a rebuild can take long: show the flush first
            if _auto_rebuild(using):
                result.rebuild_needed_since = _needed_since(buffer, using)
        record_flush(buffer, result)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_url(), exc) from exc
    if result.failed_shards:
        raise FlushFailed(result, result.failed_shards)
    return result


def _needed_since(buffer: Buffer, using: str) -> str | None:
    from .epoch import rebuild_needed_since

    since = rebuild_needed_since(buffer.prefix, using)
    return since.isoformat() if since else None


def _auto_rebuild(using: str) -> bool:
    """Run the full rebuild after a data loss; False if another one is running."""
    try:
        reports = rebuild_all(using=using)
    except RebuildRunning:
        logger.info("automatic rebuild skipped: another rebuild is running")
        return False
    for report in reports:
        logger.warning("automatic rebuild after Redis data loss: %s", report.summary())
    return True


def record_flush(buffer: Buffer, result) -> None:
    """Keep the last flush's result in Redis for ``counters_status``."""
    data = {k: json.dumps(v) for k, v in result.as_dict().items()}
    data["at"] = json.dumps(time.time())
    buffer.client.hset(f"{buffer.prefix}:last_flush", mapping=data)


def rebuild_lease(buffer: Buffer) -> Lease:
    """The lease that keeps full rebuilds and repairs of one prefix from overlapping.

    Two rebuilds confirming the same drift at once would both repair it. The
    lease outlives one page of a rebuild (its confirmation rounds included)
    and is extended after each page.
    """
    from .rebuild import CONFIRM_ROUNDS

    page = CONFIRM_ROUNDS * (2 * conf.socket_timeout() + 0.2)
    return Lease(buffer.client, f"{buffer.prefix}:rebuild", conf.lease_timeout() + page)


def repair_queued(buffer: Buffer, using: str = DEFAULT_DB_ALIAS) -> int:
    """Rebuild the keys that reads found below zero (see ``counters.repair``)."""
    if not buffer.client.exists(repair.queue_key(buffer)):
        return 0
    with rebuild_lease(buffer) as lease:
        if not lease.held:
            return 0  # a rebuild is running; the keys wait for the next flush
        return repair.repair_queued(buffer, using, limit=conf.batch_size())


def rebuild_all(
    using: str = DEFAULT_DB_ALIAS,
    *,
    batch_size: int = 1000,
    progress: Callable[[int, int], None] | None = None,
) -> list:
    """Rebuild every registered counter that has a truth source: the full rebuild.

    When it completes, the Redis data losses detected before it started are
    repaired, and their "rebuild needed" mark is cleared. Keys that kept
    changing are queued for the next flush to repair. Raises
    :class:`RebuildRunning` if another full rebuild or repair of this prefix
    is running.
    """
    from .epoch import clear_rebuild_needed
    from .rebuild import rebuild
    from .registry import all_specs

    buffer = get_buffer()
    try:
        with rebuild_lease(buffer) as lease:
            if not lease.held:
                raise RebuildRunning(lease.key)

            def page_done(done: int, total: int) -> None:
                if not lease.extend():
                    logger.warning("the rebuild lease %s expired during a rebuild", lease.key)
                if progress is not None:
                    progress(done, total)

            started = timezone.now()
            reports = []
            for spec in all_specs():
                if spec.source is not None:
                    report = rebuild(
                        spec.name, batch_size=batch_size, progress=page_done, using=using
                    )
                    logger.info("full rebuild: %s", report.summary())
                    reports.append(report)
                    repair.queue(buffer, spec.name, report.unstable)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_url(), exc) from exc
    if clear_rebuild_needed(buffer.prefix, started, using):
        logger.warning(
            "full rebuild complete: the Redis data loss of prefix %r is repaired", buffer.prefix
        )
    return reports
