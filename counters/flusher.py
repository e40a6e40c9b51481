"""Drain the buffer into counter rows: move → apply + ledger in one transaction → ack.

Exactly once: the batch id is inserted into the :class:`FlushBatch` ledger in
the same transaction as the counter updates. Whatever point a flusher dies
at, the batch stays in the shard's in-flight set until the next flush, which
applies it if its id is not in the ledger and only acknowledges it if it is.
Two flushers racing on one batch (a lease that expired mid-apply) collide on
the ledger's primary key, so one of them applies it.

Poison isolation: a batch that fails to apply for any reason but the state of
the database (:data:`SYSTEMIC`: a lost connection, a deadlock, a lock
timeout, a read-only database, a counter table renamed or missing in a
deploy window; the batch stays in flight and the shard fails this run) is
narrowed in Redis. Its second half goes back to pending and its first half
stays in flight as a batch of its own (``<id>/1``, ``<id>/2``, ...) with the
shard's next batch sequence number, applied and acknowledged like any other
(a new number, so that a Redis restored from a snapshot taken before the
narrowing is seen to be behind the DB: see :mod:`counters.epoch`). A failing
half is narrowed again, and the halves sent back are moved next by themselves: a binary
search, so 1000 members with one poison delta cost 11 failed transactions.
A member that fails alone is moved to the shard's quarantine with its error
(not applied, not lost) and the rest of the shard flows on. Every step is one
atomic script that checks the batch id in flight, so the in-flight batch is
always exactly what its ledger id covers: a crash at any point leaves a batch
that the next flush applies or only acknowledges, and reads never count a
delta twice.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from django.db import (
    DEFAULT_DB_ALIAS,
    IntegrityError,
    connections,
)
from django.db.models.sql import InsertQuery
from django.utils import timezone
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import waits
from .apply import DATABASE_ERRORS, apply_deltas
from .buffer import Batch, Buffer
from .epoch import check_epoch, record_applied, record_loss
from .lease import Lease
from .models import BufferEpoch, FlushBatch
from .utils import capped, column, first_line, model_field

logger = logging.getLogger(__name__)


@dataclass
class FlushResult:
    batches: int = 0
    keys: int = 0
    deltas: int = 0
    dropped: int = 0
    recovered: int = 0
    already_applied: int = 0
    busy_shards: list[int] = field(default_factory=list)
    lost_shards: list[int] = field(default_factory=list)
    failed_shards: dict[int, str] = field(default_factory=dict)
    compensated: int = 0
    repaired: int = 0
    quarantined: int = 0
    requeued: int = 0
    discarded: int = 0
    incomplete: bool = False
    rebuild_needed_since: str | None = None
    layouts_pending: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        text = (
            f"flushed {self.batches} batches, {self.keys} keys, {self.deltas} deltas "
            f"in {self.seconds:.3f}s"
        )
        extras = []
        if self.recovered:
            extras.append(f"{self.recovered} recovered")
        if self.already_applied:
            extras.append(f"{self.already_applied} already applied")
        if self.dropped:
            extras.append(f"{self.dropped} dropped")
        if self.busy_shards:
            extras.append(f"{len(self.busy_shards)} shards busy")
        if self.compensated:
            extras.append(f"{self.compensated} late pushes taken back")
        if self.failed_shards:
            extras.append(f"{len(self.failed_shards)} shards failed")
        if self.quarantined:
            extras.append(f"{self.quarantined} deltas quarantined")
        if self.requeued:
            extras.append(f"{self.requeued} quarantined deltas retried")
        if self.discarded:
            extras.append(f"{self.discarded} quarantined deltas discarded")
        if self.repaired:
            extras.append(f"{self.repaired} queued keys repaired")
        if self.lost_shards:
            extras.append(f"REDIS LOST DATA in {len(self.lost_shards)} shards")
        if self.rebuild_needed_since:
            extras.append(f"REBUILD NEEDED since {self.rebuild_needed_since}")
        if self.layouts_pending:
            extras.append(f"LAYOUT CHANGE NOT DRAINED: {'; '.join(self.layouts_pending)}")
        if self.incomplete:
            extras.append("time budget reached")
        return text + (f" ({', '.join(extras)})" if extras else "")

    def as_dict(self) -> dict:
        return asdict(self)


#: Longest error text logged or recorded for a failed shard or batch.
ERROR_LIMIT = 300


def new_batch_id() -> str:
    return uuid.uuid4().hex


def narrowed_id(batch_id: str) -> str:
    """Id of the batch that ``batch_id`` is narrowed to: ``<root>/<depth + 1>``.

    Short whatever the depth (a batch of 2**n members narrows n times at most).
    """
    root, _, depth = batch_id.partition("/")
    return f"{root}/{int(depth) + 1 if depth.isdigit() else 1}"


def error_line(exc: BaseException) -> str:
    """``<type>: <first line of the message>``, capped: for logs, status and quarantine."""
    text = str(exc).strip()
    return (f"{type(exc).__name__}: {first_line(exc)}" if text else type(exc).__name__)[
        :ERROR_LIMIT
    ]


#: Errors of the database rather than of a batch's deltas: the batch stays in flight as
#: it is and the shard fails this run (the next flush tries again).
SYSTEMIC = DATABASE_ERRORS


class BatchLost(Exception):
    """The batch in flight is no longer the one this flusher holds (its lease expired)."""


def record_batch(batch: Batch, using: str) -> None:
    """Insert the ledger row of ``batch`` and raise the shard's applied sequence to its own.

    Call inside the batch's transaction. On PostgreSQL both are one statement
    (one round trip per batch less); elsewhere two.
    """
    row = FlushBatch(
        batch_id=batch.batch_id,
        shard=batch.shard,
        keys=len(batch.items),
        deltas=sum(abs(d) for d in batch.items.values()),
    )
    conn = connections[using]
    if conn.vendor != "postgresql" or not (batch.seq and batch.prefix):
        row.save(using=using, force_insert=True)
        record_applied(batch, using)
        return
    query = InsertQuery(FlushBatch)
    query.insert_values(FlushBatch._meta.concrete_fields, [row])
    [(insert, params)] = query.get_compiler(using=using).as_sql()
    qn = conn.ops.quote_name
    prefix, shard, seq = (
        qn(column(model_field(BufferEpoch, f))) for f in ("prefix", "shard", "seq")
    )
    with conn.cursor() as cursor:
        cursor.execute(
            f"WITH epoch AS (UPDATE {qn(BufferEpoch._meta.db_table)} "
            f"SET {seq} = GREATEST({seq}, %s) WHERE {prefix} = %s AND {shard} = %s) {insert}",
            [batch.seq, batch.prefix, batch.shard, *params],
        )


def apply_batch(batch: Batch, using: str, result: FlushResult) -> None:
    """Apply ``batch`` unless the ledger says it already was. Raises on DB errors.

    Under :func:`counters.waits.limited` (the flush loop), the transaction's
    lock waits, statements and idle time are bounded: a lock timeout raises
    ``OperationalError``.
    """
    ledger = FlushBatch.objects.using(using)
    if batch.recovered and ledger.filter(pk=batch.batch_id).exists():
        result.already_applied += 1
        return
    try:
        with waits.atomic(using):
            # The ledger row goes first: a second applier of the same batch
            # waits on this primary key and then fails instead of adding twice.
            record_batch(batch, using)
            applied = apply_deltas(batch.items, using)
            if applied.dropped:
                ledger.filter(pk=batch.batch_id).update(
                    dropped=applied.dropped, keys=applied.keys, deltas=applied.deltas
                )
    except IntegrityError:
        if ledger.filter(pk=batch.batch_id).exists():
            result.already_applied += 1
            return
        raise
    result.batches += 1
    result.keys += applied.keys
    result.deltas += applied.deltas
    result.dropped += applied.dropped


def flush_shard(
    buffer: Buffer,
    shard: int,
    *,
    using: str,
    batch_size: int,
    lease_timeout: float,
    deadline: float,
    result: FlushResult,
) -> None:
    """Drain what ``shard`` holds now, batch by batch, under the shard's lease."""
    with Lease(buffer.client, buffer.key(shard, "lease"), lease_timeout) as lease:
        if not lease.held:
            result.busy_shards.append(shard)
            return
        epoch = check_epoch(buffer, shard, using)
        if epoch.lost:
            result.lost_shards.append(shard)
        applied_seq = epoch.seq  # only this lease holder raises it
        target = buffer.pending_count(shard)
        moved = 0
        narrowed: Batch | None = None
        batch: Batch | None
        # Members narrowed batches sent back to pending: each group is moved by itself
        # next, so that a poison delta is found in halvings, not mixed with new deltas.
        returned: list[list[str]] = []
        # The batch applied last: acknowledged by the next move, or at the end (below).
        unacked: str | None = None
        failed = False
        try:
            while True:
                if time.monotonic() >= deadline:
                    result.incomplete = True
                    return
                if lease.remaining() < lease_timeout / 2 and not lease.extend():
                    logger.warning("lost the lease of shard %s; stopping this shard", shard)
                    return
                if narrowed is not None:
                    batch = narrowed
                elif returned:
                    batch = buffer.move(
                        shard, new_batch_id(), batch_size, only=returned.pop(), ack=unacked
                    )
                    unacked = None
                    if batch is None:
                        continue
                else:
                    batch = buffer.move(shard, new_batch_id(), batch_size, ack=unacked)
                    unacked = None
                    if batch is None:
                        return
                if narrowed is not None:
                    narrowed = None
                elif batch.recovered:
                    result.recovered += 1
                    logger.info("recovering in-flight batch %s of shard %s", batch.batch_id, shard)
                elif batch.seq and batch.seq <= applied_seq and shard not in result.lost_shards:
                    # Redis went back in time since this flush checked it (a failover mid-flush).
                    record_loss(buffer, shard, using, batch.seq)
                    result.lost_shards.append(shard)
                if batch.items:
                    limits = waits.apply_limits(lease_timeout, deadline - time.monotonic())
                    try:
                        with waits.limited(limits):
                            apply_batch(batch, using, result)
                    except SYSTEMIC:
                        raise  # the database, not the deltas: the batch stays in flight as it is
                    except Exception as exc:
                        if not connections[using].is_usable():
                            raise
                        try:
                            narrowed = isolate(buffer, batch, exc, result)
                        except BatchLost:
                            logger.warning(
                                "batch %s of shard %s is no longer in flight; stopping this shard",
                                batch.batch_id,
                                shard,
                            )
                            return
                        if narrowed is not None:
                            returned.append(sorted(set(batch.items) - set(narrowed.items)))
                            if batch.recovered:
                                # Members it sent back were not counted when this run began.
                                target += len(batch.items) - len(narrowed.items)
                        elif not batch.recovered:
                            moved += len(batch.items)  # quarantined: gone from Redis
                            if moved >= target and not returned:
                                return
                        continue
                    applied_seq = max(applied_seq, batch.seq)
                unacked = batch.batch_id
                if not batch.recovered:
                    moved += len(batch.items)
                    if moved >= target and not returned:
                        return
        except BaseException:
            failed = True  # unacked stays in flight: the next flush finds it in the ledger
            raise
        finally:
            if unacked is not None and not failed:
                buffer.ack(shard, unacked)


def isolate(buffer: Buffer, batch: Batch, exc: Exception, result: FlushResult) -> Batch | None:
    """``batch`` failed with ``exc``: narrow it to its first half, or quarantine it.

    Returns the narrowed batch (now in flight) to apply next, or None when
    the batch was quarantined (one member, or none of the others could go
    back to pending). Raises :class:`BatchLost` if ``batch`` is no longer in flight.
    """
    error = error_line(exc)
    if len(batch.items) > 1:
        members = sorted(batch.items)
        half = members[len(members) // 2 :]
        smaller = buffer.narrow(batch, narrowed_id(batch.batch_id), half, True)  # renumbered
        if smaller is None:
            raise BatchLost(batch.batch_id)
        if len(smaller.items) < len(batch.items):
            logger.warning(
                "batch %s of shard %s failed (%s); applying its %s members in halves",
                batch.batch_id,
                batch.shard,
                error,
                len(batch.items),
            )
            return smaller
        batch = smaller  # nothing could go back to pending: quarantine them all
    if not buffer.quarantine(batch, error):
        raise BatchLost(batch.batch_id)
    result.quarantined += len(batch.items)
    logger.error(
        "quarantined %s deltas of shard %s that cannot be applied (%s): %s; "
        "see counters_status, then counters_flush --retry-quarantined or --discard-quarantined",
        len(batch.items),
        batch.shard,
        error,
        capped(dict(sorted(batch.items.items()))),
    )
    return None


def prune_ledger(buffer: Buffer, using: str, retention: int) -> int:
    """Delete ledger rows older than ``retention`` seconds, except batches still in flight."""
    cutoff = timezone.now() - timedelta(seconds=retention)
    keep = list(buffer.inflight_ids().values())
    deleted, _ = (
        FlushBatch.objects.using(using)
        .filter(applied_at__lt=cutoff)
        .exclude(batch_id__in=keep)
        .delete()
    )
    return deleted


def chosen_shards(buffer: Buffer, shards: Iterable[int] | None) -> list[int]:
    """``shards`` sorted without repeats (every shard of ``buffer`` if None).

    Raises ``ValueError`` for a shard that ``buffer`` does not have, or an empty set.
    """
    if shards is None:
        return list(range(buffer.shards))
    items = list(shards)
    wrong = [
        s
        for s in items
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < buffer.shards
    ]
    if wrong:
        raise ValueError(
            f"shards {wrong!r} are not shards of this buffer (0 to {buffer.shards - 1})"
        )
    chosen = sorted(set(items))
    if not chosen:
        raise ValueError("no shards to flush: pass None for every shard")
    return chosen


def flush(
    buffer: Buffer,
    *,
    using: str = DEFAULT_DB_ALIAS,
    batch_size: int = 5000,
    time_budget: float = 30.0,
    lease_timeout: float = 30.0,
    retention: int | None = None,
    shards: Iterable[int] | None = None,
) -> FlushResult:
    """Flush each shard of ``buffer`` once, or only ``shards``; returns a FlushResult.

    Each shard is drained under its own lease; shards another flusher holds
    are skipped (``busy_shards``). Several flushers given disjoint ``shards``
    (the parts of a parallel flush, see ``counters.fanout``) work side by
    side; given the same shards they still apply each batch once. Shards are
    visited from a random one on, so that a time budget that runs out leaves
    different shards behind each time. ``retention`` (seconds) prunes the
    ledger afterwards; None leaves it alone. Raises ``ValueError`` for shards
    ``buffer`` does not have, before touching any.
    """
    order = chosen_shards(buffer, shards)
    started = time.monotonic()
    deadline = started + time_budget
    result = FlushResult()
    offset = random.randrange(len(order))  # fairness when the time budget runs out
    for shard in order[offset:] + order[:offset]:
        try:
            flush_shard(
                buffer,
                shard,
                using=using,
                batch_size=batch_size,
                lease_timeout=lease_timeout,
                deadline=deadline,
                result=result,
            )
        except (RedisConnectionError, RedisTimeoutError):
            raise  # Redis is unreachable: no other shard can do better
        except Exception as exc:
            if not connections[using].is_usable():
                raise  # the database is gone: no other shard can do better
            # One shard's failure (a deadlock, a lock timeout, a Redis error reply)
            # must not hold up the others; its batch stays in flight for the next flush.
            logger.error(
                "flush of shard %s failed (%s); its batch stays in flight",
                shard,
                error_line(exc),
                exc_info=logger.isEnabledFor(logging.DEBUG),  # the traceback only when debugging
            )
            result.failed_shards[shard] = first_line(exc, ERROR_LIMIT)
    if retention is not None:
        prune_ledger(buffer, using, retention)
    result.seconds = time.monotonic() - started
    logger.debug("%s", result.summary())
    return result
