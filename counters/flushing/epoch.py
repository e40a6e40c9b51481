"""Detect Redis data loss and time travel: an epoch token and a batch sequence per shard.

Each shard holds a random token (``<prefix>:{sN}:epoch``) and a sequence
(``<prefix>:{sN}:seq``) that the move script bumps for every batch it moves, and
the narrowing of a poison batch for the half it keeps in flight.
The DB remembers the token and the highest sequence applied (``BufferEpoch``),
the latter in the same transaction as each batch. At the start of each
shard's flush, under its lease:

- the token is gone or different: Redis lost its data (restart without
  persistence, FLUSHALL, failover to an empty replica);
- the token matches but Redis's sequence is lower than the DB's: Redis came
  back from an older state (an RDB snapshot or AOF older than the last flush,
  failover to a lagging replica). Deltas applied since that state are back
  as pending and will count again; deltas pushed after it are gone.

The DB has a shard's token before the first delta enters the shard: each
process records the tokens of its buffer once, before its first push
(:func:`counters.write.preflight.record_layout`), so a Redis that loses its data before the
first flush of a prefix is a loss too.

Either is a loss: it is logged, counted, and the prefix is marked "rebuild
needed" until a full rebuild that started after the loss completes. Then the
Redis sequence is raised to the DB's, so the next flush is not flagged again.

What cannot be detected: deltas pushed after the last snapshot when no batch
was applied in between leave no trace in the DB (the sequences still agree);
without durable mode they are lost silently. The audit and a rebuild repair
the counts they leave wrong.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS
from django.db.models import F, Min
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from counters.base.exceptions import UnexpectedScriptReply
from counters.base.utils import to_str
from counters.buffer.scripts import SEQ_FLOOR_SCRIPT, DrainScript
from counters.buffer.store import Batch, Buffer
from counters.models import BufferEpoch
from counters.write.preflight import ensure_token

logger = logging.getLogger(__name__)

#: The command that repairs counters after a loss (named in logs and messages).
REBUILD_COMMAND = "manage.py counters_rebuild"

LOST_MESSAGE = (
    "Redis lost the buffer of %s under prefix %r (their epoch markers are gone or replaced: "
    "Redis restarted without persistence, was flushed, or failed over to an empty "
    "replica). Deltas buffered there before now are lost, so some counters are wrong "
    f"until a full rebuild completes: `{REBUILD_COMMAND}` (the flush runs it itself "
    "unless COUNTERS_AUTO_REBUILD is off). Enable appendonly in Redis to avoid this."
)

BEHIND_MESSAGE = (
    "Redis went back in time in %s under prefix %r: its batch sequence is behind what the "
    "DB has applied (%s; Redis restarted from an old snapshot, or failed over to "
    "a lagging replica). Deltas applied since then are pending again and deltas pushed "
    "since then are gone, so some counters are wrong until a full rebuild completes: "
    f"`{REBUILD_COMMAND}` (the flush runs it itself unless COUNTERS_AUTO_REBUILD is off)."
)

#: Seconds a loss event stays known as reported (its other shards are then not logged again).
REPORTED_TTL = 7 * 24 * 3600


@dataclass(frozen=True)
class EpochCheck:
    """Result of :func:`check_epoch`: was a loss found, and the DB's applied sequence."""

    lost: bool
    seq: int


def check_epoch(buffer: Buffer, shard: int, using: str = DEFAULT_DB_ALIAS) -> EpochCheck:
    """Check shard ``shard`` for data loss or time travel since the last check.

    Call under the shard's lease. A loss is recorded and the sequences are
    re-aligned before this returns.
    """
    raw_token, raw_seq = buffer.client.mget(buffer.key(shard, "epoch"), buffer.key(shard, "seq"))
    token, redis_seq = to_str(raw_token), int(raw_seq or 0)
    epochs = BufferEpoch.objects.using(using)
    row = epochs.filter(prefix=buffer.prefix, shard=shard).first()
    if row is not None and token == row.token and redis_seq >= row.seq:
        return EpochCheck(lost=False, seq=row.seq)
    if row is None:
        token = ensure_token(buffer, shard)
        row, _ = epochs.get_or_create(prefix=buffer.prefix, shard=shard, defaults={"token": token})
        return EpochCheck(lost=False, seq=row.seq)
    record_loss(buffer, shard, using, redis_seq)
    return EpochCheck(lost=True, seq=row.seq)


def record_loss(buffer: Buffer, shard: int, using: str, redis_seq: int) -> None:
    """Log and count a loss of ``shard``, mark the prefix "rebuild needed", re-align.

    ``redis_seq`` is the sequence Redis showed (for the log). Call under the
    shard's lease.
    """
    epochs = BufferEpoch.objects.using(using).filter(prefix=buffer.prefix, shard=shard)
    row = epochs.get()
    token = ensure_token(buffer, shard)
    report_loss(buffer, row, redis_seq, using)
    now = timezone.now()
    epochs.update(
        token=token,
        started_at=row.started_at if token == row.token else now,
        losses=F("losses") + 1,
        last_loss_at=now,
        rebuild_needed_since=Coalesce(F("rebuild_needed_since"), now),
    )
    raise_seq(buffer, shard, row.seq)


def _shards(shards: list[int]) -> str:
    return f"shard {shards[0]}" if len(shards) == 1 else f"shards {', '.join(map(str, shards))}"


def _reported_key(buffer: Buffer) -> str:
    return f"{buffer.prefix}:losses_reported"


def _event(row: BufferEpoch) -> str:
    """One shard's part of a loss event: the shard and what the DB knew of it then."""
    return f"{row.shard}:{row.token}:{row.seq}"


def report_loss(buffer: Buffer, row: BufferEpoch, redis_seq: int, using: str) -> None:
    """Log a loss event once, naming every shard it hit, when its first shard is found.

    A restart loses every shard at once, and each shard's flush finds it in turn:
    the first one reads the epoch markers of all shards and logs the lost and the
    behind ones in one message. Each shard's part of the event (its shard, token and
    sequence as the DB had them) is claimed in a Redis set, by one caller only: the
    flushes of the other shards, or lanes that found the same event at the same
    moment, log it at INFO.
    """
    reported = _reported_key(buffer)
    if buffer.client.sismember(reported, _event(row)):
        logger.info("shard %s under prefix %r: its loss was reported", row.shard, buffer.prefix)
        return
    rows = {e.shard: e for e in BufferEpoch.objects.using(using).filter(prefix=buffer.prefix)}
    rows[row.shard] = row
    pipe = buffer.client.pipeline(transaction=False)
    for shard in sorted(rows):
        pipe.get(buffer.key(shard, "epoch"))
        pipe.get(buffer.key(shard, "seq"))
    replies = pipe.execute()
    lost, behind = [], []
    for i, shard in enumerate(sorted(rows)):
        token, seq = to_str(replies[2 * i]), int(replies[2 * i + 1] or 0)
        if shard == row.shard:
            seq = min(seq, redis_seq, row.seq - 1)  # what the check saw: behind if not lost
        if token != rows[shard].token:
            lost.append(shard)
        elif seq < rows[shard].seq:
            behind.append((shard, seq if shard != row.shard else redis_seq))
    # Each shard's part is claimed once (SADD answers 1 to one caller only): flushes of other
    # shards (lanes, workers) that found the same event at the same moment log nothing again.
    found = [*lost, *(s for s, _ in behind)]
    pipe = buffer.client.pipeline(transaction=False)
    for shard in found:
        pipe.sadd(reported, _event(rows[shard]))
    pipe.expire(reported, REPORTED_TTL)
    claimed = pipe.execute()[:-1]
    mine = {s for s, new in zip(found, claimed, strict=True) if new}
    lost, behind = [s for s in lost if s in mine], [(s, q) for s, q in behind if s in mine]
    if lost:
        logger.error(LOST_MESSAGE, _shards(lost), buffer.prefix)
    if behind:
        seqs = "; ".join(f"shard {s}: {seq} of {rows[s].seq}" for s, seq in behind)
        logger.error(BEHIND_MESSAGE, _shards([s for s, _ in behind]), buffer.prefix, seqs)
    if not mine:
        logger.info("shard %s under prefix %r: its loss was reported", row.shard, buffer.prefix)


def raise_seq(buffer: Buffer, shard: int, floor: int) -> bool:
    """Raise the Redis sequence of ``shard`` to ``floor`` if it is lower."""
    script = DrainScript(buffer.client, SEQ_FLOOR_SCRIPT)
    reply = script(keys=[buffer.key(shard, "seq")], args=[floor])
    if reply not in (0, 1):
        raise UnexpectedScriptReply("SEQ_FLOOR_SCRIPT", reply)
    return reply == 1


def record_applied(batch: Batch, using: str) -> None:
    """Remember that ``batch`` was applied. Call inside the batch's DB transaction.

    One row per shard, and one flusher per shard holds the lease: no contention.
    """
    if batch.seq and batch.prefix:
        BufferEpoch.objects.using(using).filter(prefix=batch.prefix, shard=batch.shard).update(
            seq=Greatest(F("seq"), batch.seq)
        )


def mark_rebuild_needed(prefix: str, using: str = DEFAULT_DB_ALIAS) -> int:
    """A loss seen under another prefix (a retired buffer layout) makes the counters of
    ``prefix`` wrong too: mark its shards "rebuild needed" now. Returns the rows marked."""
    now = timezone.now()
    return (
        BufferEpoch.objects.using(using)
        .filter(prefix=prefix)
        .update(last_loss_at=now, rebuild_needed_since=Coalesce(F("rebuild_needed_since"), now))
    )


def rebuild_needed_since(prefix: str, using: str = DEFAULT_DB_ALIAS) -> datetime | None:
    """When the first loss not yet repaired by a full rebuild was detected, or None."""
    rows = BufferEpoch.objects.using(using).filter(prefix=prefix)
    return rows.aggregate(since=Min("rebuild_needed_since"))["since"]


def clear_rebuild_needed(prefix: str, started: datetime, using: str = DEFAULT_DB_ALIAS) -> int:
    """A full rebuild that started at ``started`` completed: clear the losses it covers.

    A loss detected after ``started`` may have happened after the rebuild
    read the keys it concerns, so it stays marked. Returns the rows cleared.
    """
    return (
        BufferEpoch.objects.using(using)
        .filter(prefix=prefix, rebuild_needed_since__isnull=False, last_loss_at__lte=started)
        .update(rebuild_needed_since=None)
    )
