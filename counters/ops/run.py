"""Flush entry points: settle, flush, repair and record, per database alias.

:func:`flush` is a whole run: what ``counters.flush()``, the ``counters_flush``
command and the Celery task (with ``COUNTERS_FLUSH_PARALLELISM`` 1) run. The
shard-by-shard engine is :func:`counters.flushing.lanes.flush_buffer`; a run split
over several workers is :mod:`counters.ops.fanout`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from django.db import DatabaseError
from django.utils import timezone
from redis import RedisError
from redis.exceptions import OutOfMemoryError

from counters.base import conf, metrics
from counters.base.exceptions import BufferUnavailable, FlushFailed, RebuildRunning, RepairFenced
from counters.base.registry import all_specs
from counters.base.utils import first_line
from counters.buffer.store import Buffer
from counters.client import flushed_databases, get_buffer
from counters.flushing import layout, quarantine, waits
from counters.flushing.epoch import rebuild_needed_since
from counters.flushing.lanes import flush_buffer
from counters.flushing.result import FlushResult, added_up
from counters.flushing.settle import settle_fallbacks
from counters.read import backfill
from counters.verify.hold import rebuild_lease, wait_for_audit
from counters.verify.rebuild import rebuild_all, rebuild_backfilling, repair_queued
from counters.write import sender
from counters.write.durable import clear_applied, drain_outbox

logger = logging.getLogger(__name__)

LAYOUT_PENDING_MESSAGE = (
    "the buffer layout of database %r changed and deltas of another layout are not drained "
    "yet: %s. Reads miss them and repairs wait. A layout on the same Redis is drained by "
    "the flush; another one by `manage.py counters_flush` run once with its settings "
    "(see counters_status and docs/operations.md)."
)


@metrics.observe_flush
def flush(
    *,
    using: str | None = None,
    time_budget: float | None = None,
    retry_quarantined: bool = False,
    discard_quarantined: bool = False,
) -> FlushResult:
    """Flush every shard of database ``using`` once; returns a FlushResult.

    Without ``using``, every database of :func:`flushed_databases` is flushed (see
    :func:`flush_databases`) and the result is their sum.
    ``retry_quarantined`` first puts the quarantined deltas back into the
    buffer, ``discard_quarantined`` drops them (see ``counters.flushing.quarantine``),
    under the rebuild lease and its fence: :class:`RebuildRunning` is raised,
    before anything is done, while a rebuild or repair holds it.
    Then rebuilds the keys queued by reads below zero, and, while Redis data
    loss is not repaired yet ("rebuild needed") and ``COUNTERS_AUTO_REBUILD``
    is on, runs the full rebuild. ``result.rebuild_needed_since`` tells if
    counters are still wrong. Records the result for ``counters_status``.
    Raises :class:`BufferUnavailable` when Redis cannot be reached and
    :class:`FlushFailed` (carrying the result) when some shards failed.
    """
    sender.push_queued(using)  # what this process committed is flushed too
    if using is None:
        results = flush_databases(
            time_budget=time_budget,
            retry_quarantined=retry_quarantined,
            discard_quarantined=discard_quarantined,
        )
        return added_up(list(results.values()))
    buffer = get_buffer(using)
    budget = conf.flush_time_budget() if time_budget is None else time_budget
    # No lock wait of this flush outlasts its time budget (counters.flushing.waits).
    with waits.session(using, waits.apply_limits(conf.lease_timeout(), budget)):
        result = _flush_one(buffer, using, budget, retry_quarantined, discard_quarantined)
    if result.failed_shards:
        raise FlushFailed(result, result.failed_shards)
    return result


def _flush_one(
    buffer: Buffer,
    using: str,
    time_budget: float,
    retry_quarantined: bool,
    discard_quarantined: bool,
) -> FlushResult:
    """The body of :func:`flush` for one database; returns the result, failed shards or not."""

    try:
        requeued, discarded = settle_quarantine(
            buffer, using, retry=retry_quarantined, discard=discard_quarantined
        )
        # Fence late pushes first, so that what they added and what takes it
        # back cancel out in the pending set before this flush moves it.
        compensated = settle_fallbacks(buffer, using)
        # Durable mode: push what dead or stuck writers left in the outbox, before the move.
        drain_outbox(buffer, using)
        layout.claim(buffer, using)
        backfill.see(all_specs(), using)  # before this flush stores anything of a new counter
        started = timezone.now()  # after the claim: a complete run drains what it retired
        deadline = time.monotonic() + time_budget
        result = flush_buffer(
            buffer,
            using=using,
            batch_size=conf.batch_size(),
            time_budget=time_budget,
            lease_timeout=conf.lease_timeout(),
            retention=conf.ledger_retention(),
        )
        clear_applied(buffer, using)  # durable mode: rows of pushes this flush counted
        layout.drain_retired(
            buffer,
            using,
            started=started,
            deadline=deadline,
            batch_size=conf.batch_size(),
            lease_timeout=conf.lease_timeout(),
            result=result,
        )
        result.layouts_pending = layout.pending(buffer, using)
        if result.layouts_pending:
            logger.error(LAYOUT_PENDING_MESSAGE, using, "; ".join(result.layouts_pending))
        result.compensated = compensated
        result.requeued, result.discarded = requeued, discarded
        repair_and_rebuild(buffer, using, result, lambda: record_flush(buffer, result))
        record_flush(buffer, result)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_where(), exc) from exc
    return result


def repair_and_rebuild(
    buffer: Buffer, using: str, result: FlushResult, show: Callable[[], None]
) -> None:
    """Rebuild the keys read below zero; while a data loss is unrepaired, the full rebuild.

    The full rebuild runs only with ``COUNTERS_AUTO_REBUILD``, after ``show()``
    has recorded the result (a rebuild can take long). Neither runs while a
    layout change is not drained: reads miss its deltas, a repair would count
    them twice. Sets ``repaired`` and ``rebuild_needed_since`` of ``result``. Then, the
    same way, the full rebuild of the counters still backfilling (new over existing rows).
    """
    result.repaired = 0 if result.layouts_pending else repair_queued(buffer, using)
    result.rebuild_needed_since = needed_since(buffer, using)
    if result.rebuild_needed_since and conf.auto_rebuild_enabled() and not result.layouts_pending:
        show()
        if rebuild_after_loss(using):
            result.rebuild_needed_since = needed_since(buffer, using)
    if conf.auto_rebuild_enabled() and not result.layouts_pending and backfill.backfilling(using):
        show()
        rebuild_new_counters(using)


def flush_databases(
    *,
    time_budget: float | None = None,
    retry_quarantined: bool = False,
    discard_quarantined: bool = False,
) -> dict[str, FlushResult]:
    """Flush each database of :func:`flushed_databases` once; returns {alias: FlushResult}.

    Each database gets its own time budget. One database failing does not
    keep the others from being flushed: once all have run, the first error is
    raised again. Redis being unreachable stops at once (it is one Redis).
    """
    results: dict[str, FlushResult] = {}
    error: Exception | None = None
    aliases = flushed_databases()
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
                logger.error("flush of database %r failed: %s", alias, first_line(exc, 300))
            error = error or exc
    if error is not None:
        raise error
    return results


def settle_quarantine(buffer: Buffer, using: str, *, retry: bool, discard: bool) -> tuple[int, int]:
    """Retry or discard the quarantine of ``buffer`` as a fenced repair; (requeued, discarded).

    Takes the rebuild lease (waiting for an audit run to end) and applies
    under its fencing token. Raises :class:`RebuildRunning` when a rebuild or
    another repair holds the lease, or took it over: the quarantine is left
    as it is, and the operator runs it again later.
    """
    if not (retry or discard):
        return 0, 0
    with rebuild_lease(buffer, using) as lease:
        if not lease.held and not wait_for_audit(buffer, lease):
            raise RebuildRunning(lease.key)
        assert lease.fence is not None
        try:
            if retry:
                return quarantine.retry(buffer, lease.fence), 0
            return 0, quarantine.discard(buffer, lease.fence)
        except RepairFenced as exc:
            raise RebuildRunning(lease.key) from exc


def needed_since(buffer: Buffer, using: str) -> str | None:
    """When counters of ``using`` became wrong through a Redis data loss (ISO), or None."""

    since = rebuild_needed_since(buffer.prefix, using)
    return since.isoformat() if since else None


def rebuild_new_counters(using: str) -> bool:
    """Backfill the new counters over existing rows; False if another rebuild is running."""
    try:
        rebuild_backfilling(using)
    except RebuildRunning:
        logger.info("backfill of new counters skipped: another rebuild is running")
        return False
    except RepairFenced as exc:
        logger.warning("backfill of new counters stopped: %s", exc)
        return False
    return True


def rebuild_after_loss(using: str) -> bool:
    """Run the full rebuild after a data loss; False if another one is running."""
    try:
        reports = rebuild_all(using=using)
    except RebuildRunning:
        logger.info("automatic rebuild skipped: another rebuild is running")
        return False
    except RepairFenced as exc:
        logger.warning("automatic rebuild stopped: %s", exc)
        return False
    for report in reports:
        logger.warning("automatic rebuild after Redis data loss: %s", report.summary())
    return True


def record_flush(buffer: Buffer, result: FlushResult) -> None:
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
