"""The ledger of applied batches: a batch's row, written in its transaction, and pruning.

A batch id in :class:`~counters.models.FlushBatch` has been applied, one that
is not has not: :func:`record_batch` runs inside the transaction that applies
the batch's deltas, so the row and the counter updates commit together or not
at all. :func:`prune_ledger` forgets old rows, never those of a batch still in
flight (the next flush must find them to acknowledge it without applying it twice).
"""

from __future__ import annotations

from datetime import timedelta

from django.db import connections
from django.db.models.sql import InsertQuery
from django.utils import timezone

from counters.base.utils import batched, column, model_field
from counters.buffer.store import Batch, Buffer
from counters.flushing.epoch import record_applied
from counters.models import BufferEpoch, FlushBatch

#: Ledger rows deleted by one statement of :func:`prune_ledger`, and by one call.
PRUNE_CHUNK = 1000
PRUNE_LIMIT = 100_000


def record_batch(batch: Batch, using: str) -> None:
    """Insert the ledger row of ``batch`` and raise the shard's applied sequence to its own.

    Call inside the batch's transaction. On PostgreSQL both are one statement
    (one round trip per batch less); elsewhere two.
    """
    row = FlushBatch(
        batch_id=batch.batch_id,
        shard=batch.shard,
        keys=len(batch.items),
        deltas=sum(map(abs, batch.items.values())),
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


def prune_ledger(buffer: Buffer, using: str, retention: int) -> int:
    """Delete ledger rows older than ``retention`` seconds, except batches still in flight.

    The old rows are read first and deleted by primary key, so the DELETE locks
    only them: InnoDB's DELETE by ``applied_at`` would lock every row it scans,
    and wait for a frozen flusher's uncommitted one past the flush's budget.
    At most :data:`PRUNE_LIMIT` rows a call: the next run deletes the rest.
    """
    cutoff = timezone.now() - timedelta(seconds=retention)
    keep = set(buffer.inflight_ids().values())
    rows = FlushBatch.objects.using(using)
    old = rows.filter(applied_at__lt=cutoff).order_by().values_list("batch_id", flat=True)
    deleted = 0
    for chunk in batched([i for i in old[:PRUNE_LIMIT] if i not in keep], PRUNE_CHUNK):
        deleted += rows.filter(batch_id__in=chunk).delete()[0]
    return deleted
