"""Drain the buffer into counter rows: move → apply + ledger in one transaction → ack.

Exactly once: the batch id is inserted into the :class:`FlushBatch` ledger in
the same transaction as the counter updates. Whatever point a flusher dies
at, the batch stays in the shard's in-flight set until the next flush, which
applies it if its id is not in the ledger and only acknowledges it if it is.
Two flushers racing on one batch (a lease that expired mid-apply) collide on
the ledger's primary key, so one of them applies it.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from django.db import DatabaseError, IntegrityError, connections, transaction
from django.utils import timezone

from .apply import apply_deltas
from .buffer import Batch, Buffer
from .epoch import check_epoch, record_applied, record_loss
from .lease import Lease
from .models import FlushBatch

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
    incomplete: bool = False
    rebuild_needed_since: str | None = None
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
        if self.repaired:
            extras.append(f"{self.repaired} queued keys repaired")
        if self.lost_shards:
            extras.append(f"REDIS LOST DATA in {len(self.lost_shards)} shards")
        if self.rebuild_needed_since:
            extras.append(f"REBUILD NEEDED since {self.rebuild_needed_since}")
        if self.incomplete:
            extras.append("time budget reached")
        return text + (f" ({', '.join(extras)})" if extras else "")

    def as_dict(self) -> dict:
        return asdict(self)


def new_batch_id() -> str:
    return uuid.uuid4().hex


def apply_batch(batch: Batch, using: str, result: FlushResult) -> None:
    """Apply ``batch`` unless the ledger says it already was. Raises on DB errors."""
    ledger = FlushBatch.objects.using(using)
    if batch.recovered and ledger.filter(pk=batch.batch_id).exists():
        result.already_applied += 1
        return
    try:
        with transaction.atomic(using=using):
            # The ledger row goes first: a second applier of the same batch
            # waits on this primary key and then fails instead of adding twice.
            ledger.create(
                batch_id=batch.batch_id,
                shard=batch.shard,
                keys=len(batch.items),
                deltas=sum(abs(d) for d in batch.items.values()),
            )
            applied = apply_deltas(batch.items, using)
            record_applied(batch, using)
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
        while True:
            if time.monotonic() >= deadline:
                result.incomplete = True
                return
            if lease.remaining() < lease_timeout / 2 and not lease.extend():
                logger.warning("lost the lease of shard %s; stopping this shard", shard)
                return
            batch = buffer.move(shard, new_batch_id(), batch_size)
            if batch is None:
                return
            if batch.recovered:
                result.recovered += 1
                logger.info("recovering in-flight batch %s of shard %s", batch.batch_id, shard)
            elif batch.seq and batch.seq <= applied_seq and shard not in result.lost_shards:
                # Redis went back in time since this flush checked it (a failover mid-flush).
                record_loss(buffer, shard, using, batch.seq)
                result.lost_shards.append(shard)
            if batch.items:
                apply_batch(batch, using, result)
                applied_seq = max(applied_seq, batch.seq)
            buffer.ack(shard, batch.batch_id)
            if not batch.recovered:
                moved += len(batch.items)
                if moved >= target:
                    return


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


def flush(
    buffer: Buffer,
    *,
    using: str = "default",
    batch_size: int = 1000,
    time_budget: float = 30.0,
    lease_timeout: float = 30.0,
    retention: int | None = None,
) -> FlushResult:
    """Flush every shard of ``buffer`` once. Shards another flusher holds are skipped."""
    started = time.monotonic()
    deadline = started + time_budget
    result = FlushResult()
    shards = list(range(buffer.shards))
    offset = random.randrange(len(shards))  # fairness when the time budget runs out
    for shard in shards[offset:] + shards[:offset]:
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
        except DatabaseError as exc:
            if not connections[using].is_usable():
                raise  # the database is gone: no other shard can do better
            # One shard's failure (a poison batch, a deadlock) must not hold up
            # the others; its batch stays in flight for the next flush.
            logger.exception("flush of shard %s failed; its batch stays in flight", shard)
            lines = str(exc).strip().splitlines()
            result.failed_shards[shard] = lines[0] if lines else type(exc).__name__
    if retention is not None:
        prune_ledger(buffer, using, retention)
    result.seconds = time.monotonic() - started
    logger.debug("%s", result.summary())
    return result
