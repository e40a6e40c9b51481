"""The Django layer: settings → Buffer, the write path, reads, and flush entry points."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from django.core.signals import setting_changed
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    OperationalError,
    connections,
    router,
    transaction,
)
from django.dispatch import receiver
from django.utils import timezone
from redis import Redis, RedisError
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from . import conf, quarantine, repair, transactions
from .buffer import Buffer
from .exceptions import (
    BufferUnavailable,
    FlushFailed,
    RebuildRunning,
    ScoreLimitExceeded,
    StalePush,
)
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


_current: dict[str, Buffer] = {}


def get_buffer(using: str = DEFAULT_DB_ALIAS) -> Buffer:
    """The Buffer of database ``using``, configured by the ``COUNTERS_*`` settings.

    Each database has a buffer of its own, so deltas go back to the database
    they were recorded on: the key prefix is ``COUNTERS_KEY_PREFIX`` for
    "default" and ``<prefix>.<alias>`` for any other alias.

    Cached for the hot path; a changed setting (``setting_changed``, as sent by
    ``override_settings``) makes the next call read the settings again.
    """
    buffer = _current.get(using)
    if buffer is not None:
        return buffer
    url, timeout = conf.redis_url(), conf.socket_timeout()
    prefix, shards = buffer_prefix(using), conf.shards()
    key = (url, timeout, prefix, shards)
    buffer = _buffers.get(key)
    if buffer is None:
        buffer = _buffers[key] = Buffer(get_client(url, timeout), prefix, shards)
    _current[using] = buffer
    return buffer


def buffer_prefix(using: str = DEFAULT_DB_ALIAS) -> str:
    """Key prefix of the buffer of database ``using`` (the default's is the bare prefix)."""
    prefix = conf.key_prefix()
    return prefix if using == DEFAULT_DB_ALIAS else f"{prefix}.{using}"


def databases() -> list[str]:
    """Aliases that a flush without an alias drains (``COUNTERS_DATABASES``).

    Default: every database the routers let the counters app migrate to.
    """
    configured = conf.databases()
    if configured is not None:
        return configured
    return [alias for alias in connections if router.allow_migrate(alias, "counters")]


@receiver(setting_changed)
def _forget_buffer(setting: str, **kwargs: Any) -> None:
    if setting.startswith("COUNTERS_") or setting == "REDIS_URL":
        _current.clear()


# -- write path ---------------------------------------------------------------


def add(name: str, key: Any, delta: int = 1, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Add ``delta`` to counter ``name`` at ``key`` once the current transaction commits.

    Raises :class:`InvalidKey` if ``key`` is not a valid key of the counter.
    """
    add_many(name, {key: delta}, using=using)


def add_many(name: str, deltas: Mapping[Any, int], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Add several deltas ({key: delta}) to counter ``name`` after commit.

    Keys are normalised first (``"7"`` and ``7`` are one key, their deltas
    add up); a key that is not valid raises :class:`InvalidKey` and nothing
    of the call is recorded.
    """
    spec = get_spec(name)
    members: dict[str, int] = {}
    for key, delta in deltas.items():
        member = spec.member(key)
        members[member] = members.get(member, 0) + delta
    changed = {member: delta for member, delta in members.items() if delta}
    if changed:
        transactions.record(changed, using, send)


def send(deltas: Mapping[str, int], using: str) -> None:
    """Push committed deltas to Redis; if Redis fails, apply them to the DB directly.

    Deltas that a Redis score cannot sum exactly (2**53 and beyond) are
    applied to the DB directly as well. Never raises: it runs after COMMIT,
    where the request has already succeeded.
    """
    push_id = uuid.uuid4().hex
    buffer = get_buffer(using)
    rest = {member: delta for member, delta in deltas.items() if delta}
    direct: dict[str, int] = {}
    maybe_sent = pushed = False
    for attempt in (1, 2):
        try:
            _push_exact(buffer, rest, direct, push_id)
            pushed = True
            break
        except (RedisError, StalePush) as exc:
            # The push is idempotent per push_id, so one repeat is safe even if
            # the first attempt ran and only its reply was lost. A failure after
            # the command left (a timeout, a reset) may still deliver it later:
            # the direct write then stays unsettled until a flush fences it.
            maybe_sent = maybe_sent or "connecting" not in str(exc)
            if attempt == 2:
                logger.warning(
                    "Redis push failed (%s); writing %s deltas to the DB", exc, len(rest)
                )
    if direct:
        # These never entered Redis: nothing to fence, a settled write.
        write_direct(direct, using)
    if not pushed and rest:
        write_direct(rest, using, push_id=push_id, unsettled=maybe_sent)


def _push_exact(buffer: Buffer, rest: dict[str, int], direct: dict[str, int], push_id: str) -> None:
    """Push ``rest``, moving the members Redis refuses as too large from ``rest`` to ``direct``.

    A refused shard added nothing, so pushing the remainder again with the
    same id completes it, while the shards that took the push ignore the repeat.
    """
    for _ in range(len(rest) + 1):
        try:
            buffer.push(rest, push_id)
            return
        except ScoreLimitExceeded as exc:
            for member in exc.members:
                direct[member] = rest.pop(member)
            logger.info(
                "%s deltas reach 2**53, beyond exact Redis scores; writing them to the DB: %s",
                len(exc.members),
                _capped(exc.members),
            )
    raise AssertionError("unreachable: every refusal removes a member")


def _capped(deltas: Mapping[str, int], limit: int = 20) -> dict[str, int]:
    """At most ``limit`` of ``deltas``, for a log line."""
    return dict(list(deltas.items())[:limit])


def write_direct(
    deltas: Mapping[str, int],
    using: str,
    *,
    push_id: str | None = None,
    unsettled: bool = False,
    attempts: int = 3,
) -> None:
    """Apply deltas to the DB now, recorded in the ledger as a fallback batch.

    Deltas whose counted row is gone are dropped (and counted), the others
    applied: a row deleted while the transaction ran fails it at COMMIT, and
    the next attempt no longer finds that row.
    """
    global fallback_count
    from .apply import apply_deltas
    from .models import FALLBACK_PREFIX, FlushBatch

    batch_id = f"{FALLBACK_PREFIX}{push_id or uuid.uuid4().hex}"
    ledger = FlushBatch.objects.using(using)
    conn = connections[using]
    # Right after the COMMIT of a manual transaction (autocommit off) this
    # write must be a transaction of its own, committed here.
    manual = not conn.in_atomic_block and not conn.get_autocommit()
    for attempt in range(1, attempts + 1):
        try:
            with transaction.atomic(using=using):
                applied = apply_deltas(deltas, using)
                ledger.create(
                    batch_id=batch_id,
                    kind=FlushBatch.Kind.FALLBACK,
                    keys=applied.keys,
                    deltas=applied.deltas,
                    dropped=applied.dropped,
                    unsettled=dict(deltas) if unsettled else None,
                )
            if manual:
                conn.commit()
            fallback_count += 1
            return
        except (OperationalError, IntegrityError) as exc:
            if manual:
                conn.rollback()
            # A deadlock or lock timeout, or a foreign-key target deleted meanwhile
            # (the deferred check fails at COMMIT): try again.
            if isinstance(exc, IntegrityError) and ledger.filter(pk=batch_id).exists():
                return  # this write was applied already
            if attempt == attempts:
                logger.exception(
                    "could not write %s deltas to the DB: %r", len(deltas), _capped(deltas)
                )
                return
            time.sleep(0.05 * attempt)
        except Exception:
            if manual:
                conn.rollback()
            logger.exception(
                "could not write %s deltas to the DB: %r", len(deltas), _capped(deltas)
            )
            return


def settle_fallbacks(buffer: Buffer, using: str = DEFAULT_DB_ALIAS, limit: int = 500) -> int:
    """Fence the pushes of direct writes that may still arrive; undo any that did.

    A push that timed out can reach Redis later (a healed partition, a stalled
    server). Fencing sets its push marker, so it can never apply from now on;
    if the marker shows it already did, the same deltas were counted by the
    direct write too, and a compensating push (idempotent: a derived id)
    takes them back. Returns the number of compensated writes.
    """
    from .buffer import PUSH_MARKER_TTL_MS
    from .models import FALLBACK_PREFIX, FlushBatch

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
            if not _take_back(buffer, undo, f"{push_id}-undo", using):
                continue  # the DB refused the take-back: the next flush tries again
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


def _take_back(buffer: Buffer, undo: dict[str, int], undo_id: str, using: str) -> bool:
    """Push ``undo`` once (id ``undo_id``); what Redis does not take goes to the DB directly.

    Redis refuses a member whose pending sum would reach 2**53, and every
    push when it is at maxmemory. The push id is then fenced where it did not
    apply, and those members are written to the DB as a settled direct write
    (id ``fallback-<undo_id>``): taking back in the DB what the late push
    added in Redis nets out the same once the flush applies it. Safe to
    repeat. Returns False if the direct write failed (it is logged; the
    caller tries again later).
    """
    from .models import FALLBACK_PREFIX, FlushBatch

    batch_id = f"{FALLBACK_PREFIX}{undo_id}"
    ledger = FlushBatch.objects.using(using)
    if ledger.filter(pk=batch_id).exists():
        return True  # taken back in the DB already: pushing it now would take it twice
    rest, direct = dict(undo), {}
    try:
        _push_exact(buffer, rest, direct, undo_id)
    except (RedisConnectionError, RedisTimeoutError):
        raise
    except (RedisError, StalePush) as exc:  # Redis at maxmemory refuses pushes
        logger.info("Redis refused a take-back push (%s); writing it to the DB", exc)
    # Shards where the push did not apply (refused now, or fenced by an earlier
    # attempt whose direct write failed) take it back in the DB.
    landed = buffer.fence(rest, undo_id)
    direct.update({m: d for m, d in rest.items() if buffer.shard_of(m) not in landed})
    if not direct:
        return True
    write_direct(direct, using, push_id=undo_id)
    return ledger.filter(pk=batch_id).exists()


# -- flush ----------------------------------------------------------------------


def flush(
    *,
    using: str | None = None,
    time_budget: float | None = None,
    retry_quarantined: bool = False,
    discard_quarantined: bool = False,
):
    """Flush every shard of database ``using`` once; returns a FlushResult.

    Without ``using``, every database of :func:`databases` is flushed (see
    :func:`flush_databases`) and the result is their sum.
    ``retry_quarantined`` first puts the quarantined deltas back into the
    buffer, ``discard_quarantined`` drops them (see ``counters.quarantine``).
    Then rebuilds the keys queued by reads below zero, and, while Redis data
    loss is not repaired yet ("rebuild needed") and ``COUNTERS_AUTO_REBUILD``
    is on, runs the full rebuild. ``result.rebuild_needed_since`` tells if
    counters are still wrong. Records the result for ``counters_status``.
    Raises :class:`BufferUnavailable` when Redis cannot be reached and
    :class:`FlushFailed` (carrying the result) when some shards failed.
    """
    from .flusher import flush as run_flush

    if using is None:
        results = flush_databases(
            time_budget=time_budget,
            retry_quarantined=retry_quarantined,
            discard_quarantined=discard_quarantined,
        )
        return _added_up(list(results.values()))
    buffer = get_buffer(using)
    try:
        requeued = quarantine.retry(buffer) if retry_quarantined else 0
        discarded = quarantine.discard(buffer) if discard_quarantined else 0
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
        result.requeued, result.discarded = requeued, discarded
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


def flush_databases(
    *,
    time_budget: float | None = None,
    retry_quarantined: bool = False,
    discard_quarantined: bool = False,
) -> dict:
    """Flush each database of :func:`databases` once; returns {alias: FlushResult}.

    Each database gets its own time budget. One database failing does not
    keep the others from being flushed: once all have run, the first error is
    raised again. Redis being unreachable stops at once (it is one Redis).
    """
    results: dict = {}
    error: Exception | None = None
    aliases = databases()
    for alias in aliases:
        try:
            results[alias] = flush(
                using=alias,
                time_budget=time_budget,
                retry_quarantined=retry_quarantined,
                discard_quarantined=discard_quarantined,
            )
        except BufferUnavailable:
            raise
        except (FlushFailed, DatabaseError) as exc:
            if len(aliases) > 1:  # name the database; the caller sees only the first error
                line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                logger.error("flush of database %r failed: %s", alias, line[:300])
            error = error or exc
    if error is not None:
        raise error
    return results


def _added_up(results: list):
    """One FlushResult of several: counts added, flags or-ed, shard lists merged."""
    from .flusher import FlushResult

    if len(results) == 1:
        return results[0]
    total = FlushResult()
    for result in results:
        for item in dataclasses.fields(result):
            mine, theirs = getattr(total, item.name), getattr(result, item.name)
            if isinstance(mine, list):
                theirs = sorted(set(mine) | set(theirs))
            elif isinstance(mine, dict):
                theirs = {**theirs, **mine}
            elif isinstance(mine, bool) or mine is None or isinstance(mine, str):
                theirs = mine or theirs
            else:
                theirs = mine + theirs
            setattr(total, item.name, theirs)
    return total


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
    """Keep the last flush's result in Redis for ``counters_status``.

    Skipped (with a log line) when Redis is at maxmemory: draining it does
    not need this record.
    """
    data = {k: json.dumps(v) for k, v in result.as_dict().items()}
    data["at"] = json.dumps(time.time())
    try:
        buffer.client.hset(f"{buffer.prefix}:last_flush", mapping=data)
    except OutOfMemoryError:
        logger.warning(
            "Redis is at maxmemory: the result of this flush is not recorded for "
            "counters_status (%s)",
            result.summary(),
        )


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

    buffer = get_buffer(using)
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
