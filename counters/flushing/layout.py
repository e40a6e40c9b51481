"""A buffer layout change, on the flush side: retire, drain, report.

Each process records its buffer layout (prefix, shards, cluster) before its
first push (:mod:`counters.write.preflight`). The flush under the layout in
use (the "current" one) claims it and retires every other recorded layout of
its database. A retired layout on the same kind of Redis (cluster or not) is
drained by that flush itself: every shard of it once, then its shards that
the current buffer does not have whenever they hold something again. One on
another kind cannot be reached: it is drained by a flush run with the old
settings (a flush under a retired layout drains that layout only, and
retires nothing). Either way a layout is drained once a complete flush that
started after it was retired left nothing of it in Redis; until then it is
pending: reads miss its deltas, so the audit and rebuilds repair nothing,
and the flush and ``counters_status`` report it.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import TYPE_CHECKING

from django.utils import timezone

from counters.base.exceptions import LayoutChangePending
from counters.buffer.store import Buffer
from counters.flushing.epoch import mark_rebuild_needed
from counters.flushing.lanes import flush_buffer
from counters.models import BufferLayout, describe_layout
from counters.write.preflight import is_cluster

if TYPE_CHECKING:
    from counters.flushing.result import FlushResult

logger = logging.getLogger(__name__)


def current_row(buffer: Buffer, using: str) -> BufferLayout:
    """The row of ``buffer``'s layout in DB ``using``, created if missing."""

    row, _ = BufferLayout.objects.using(using).get_or_create(
        prefix=buffer.prefix, shards=buffer.shards, cluster=is_cluster(buffer)
    )
    return row


def claim(buffer: Buffer, using: str) -> BufferLayout:
    """A flush under ``buffer`` starts: retire every other layout, unless ``buffer``'s own
    is retired and stays so (then this flush is a drain of it). Returns ``buffer``'s row.

    A retired layout is taken back into use (:func:`takes_back`) when its flush
    can reach every layout in use: a deploy that goes back to earlier settings.
    """

    row = current_row(buffer, using)
    if row.retired_at is not None and takes_back(buffer, row, using):
        BufferLayout.objects.using(using).filter(pk=row.pk).update(retired_at=None)
        row.retired_at = None
        logger.warning("buffer layout %s is flushed again: in use again", row)
    if row.retired_at is None:
        retired = (
            BufferLayout.objects.using(using)
            .filter(retired_at__isnull=True)
            .exclude(pk=row.pk)
            .update(retired_at=timezone.now())
        )
        if retired:
            logger.warning(
                "the buffer layout is now %s: %s other layouts retired, drained by the flush",
                row,
                retired,
            )
    return row


def in_use(row: BufferLayout | None, using: str) -> list[BufferLayout]:
    """The layouts of DB ``using`` besides ``row`` that are not retired."""
    rows = BufferLayout.objects.using(using).filter(retired_at__isnull=True)
    return list(rows.exclude(pk=row.pk) if row is not None else rows)


def takes_back(buffer: Buffer, row: BufferLayout, using: str) -> bool:
    """Does a flush under ``buffer`` (``row``, retired) take its layout back into use?

    Yes when it can reach every layout in use, so that it drains them: the
    process runs settings taken back. No when one is on the other kind of
    Redis: it is the flush run with the old settings to drain ``row`` alone.
    During a rolling deploy on one Redis, flushers of the old and the new
    settings take the layout from each other, each draining the other's
    shards, until the old ones stop; every delta is applied once all the same.
    """
    return all(reachable(buffer, other) for other in in_use(row, using))


def others(buffer: Buffer, row: BufferLayout, using: str) -> list[BufferLayout]:
    """The layouts of DB ``using`` besides ``row`` that a flush under ``buffer`` answers for:
    every other one, or none for a flush under a retired layout (a drain of it)."""

    if row.retired_at is not None:
        return []
    return list(BufferLayout.objects.using(using).exclude(pk=row.pk))


def reachable(buffer: Buffer, other: BufferLayout) -> bool:
    """Can ``buffer``'s client reach ``other``'s keys? Only on the same kind of Redis."""
    return other.cluster == is_cluster(buffer)


def buffer_of(buffer: Buffer, other: BufferLayout) -> Buffer:
    """A buffer of layout ``other`` on ``buffer``'s client."""
    return Buffer(buffer.client, other.prefix, other.shards)


def exclusive_shards(buffer: Buffer, other: BufferLayout) -> list[int]:
    """Shards of ``other`` that a flush of ``buffer`` does not drain by itself."""
    if other.prefix == buffer.prefix:
        return list(range(buffer.shards, other.shards))
    return list(range(other.shards))


def shards_holding(buffer: Buffer, shards: list[int]) -> list[int]:
    """Those of ``shards`` of ``buffer`` that hold pending deltas or a batch in flight."""
    if not shards:
        return []
    pipe = buffer.client.pipeline(transaction=False)
    for shard in shards:
        pipe.exists(buffer.key(shard, "pending"), buffer.key(shard, "batch"))
    return [shard for shard, n in zip(shards, pipe.execute(), strict=True) if int(n)]


def is_drained(row: BufferLayout) -> bool:
    """Retired, and a complete flush started since left nothing of it in Redis."""
    return (
        row.retired_at is not None
        and row.drained_at is not None
        and row.drained_at >= row.retired_at
    )


def mark_drained(row: BufferLayout, started: datetime, using: str) -> None:
    """A complete flush that started at ``started`` left nothing of ``row`` in Redis."""

    if row.retired_at is not None and started >= row.retired_at and not is_drained(row):
        BufferLayout.objects.using(using).filter(pk=row.pk).update(drained_at=started)
        row.drained_at = started
        logger.warning("buffer layout %s is drained: nothing of it is left in Redis", row)


def pending(buffer: Buffer, using: str, *, live: bool = True) -> list[str]:
    """The layouts whose deltas a flush under ``buffer`` has not drained yet (described).

    For a flush under the layout in use: every other layout not yet retired
    (writers may still use it), not yet drained, or (when reachable) whose
    exclusive shards hold something again. For a drain of a retired layout:
    that layout, until it is drained, and the layouts in use that it can
    reach (its next flush takes it back and drains them). ``live=False`` asks
    the DB only (Redis cannot be reached).
    """

    rows = BufferLayout.objects.using(using)
    row = rows.filter(
        prefix=buffer.prefix, shards=buffer.shards, cluster=is_cluster(buffer)
    ).first()
    if row is not None and row.retired_at is not None:
        # Reads under it miss what the layouts in use hold too, when it could drain them.
        taken = [str(o) for o in in_use(row, using) if reachable(buffer, o)]
        return taken if is_drained(row) else [str(row), *taken]
    waiting = []
    for other in rows.exclude(pk=row.pk) if row is not None else rows:
        left = (
            live
            and reachable(buffer, other)
            and shards_holding(buffer_of(buffer, other), exclusive_shards(buffer, other))
        )
        if not is_drained(other) or left:
            waiting.append(str(other))
    return waiting


def drain_retired(
    buffer: Buffer,
    using: str,
    *,
    started: datetime,
    deadline: float,
    batch_size: int,
    lease_timeout: float,
    result: FlushResult,
    own_shards_flushed: bool = True,
) -> None:
    """After the flush of ``buffer`` (``result``, started at ``started``), drain the retired
    layouts it can reach, adding what it applied to ``result``; mark what is drained.

    A retired layout not drained yet has every shard flushed once (those it
    shares with ``buffer`` too: under another shard count a member's deltas
    may sit in a shard that reads no longer look in); a drained one only its
    exclusive shards that hold something again (a process still writing with
    the old settings). A flush under a retired layout drains it: it is
    drained if that flush was complete and left nothing in Redis (not
    ``own_shards_flushed``: the caller did not flush ``buffer``'s shards itself).
    """
    row = current_row(buffer, using)
    if row.retired_at is not None:  # a drain of this layout: its every shard was flushed
        if own_shards_flushed and complete(result):
            mark_drained_if_empty(buffer, row, started, using)
        return
    for other in others(buffer, row, using):
        shards = due_shards(buffer, other)
        if not shards:
            continue
        budget = deadline - time.monotonic()
        if budget <= 0:
            result.incomplete = True
            return
        begun = timezone.now()
        old = buffer_of(buffer, other)
        part = flush_buffer(
            old,
            using=using,
            batch_size=batch_size,
            time_budget=budget,
            lease_timeout=lease_timeout,
            shards=shards,
        )
        add_to(result, part, other)
        if part.lost_shards and other.prefix != buffer.prefix:
            # Its counts are this prefix's counts: loud here until a full rebuild.

            mark_rebuild_needed(buffer.prefix, using)
        if complete(part) and not shards_holding(old, exclusive_shards(buffer, other)):
            mark_drained(other, begun, using)


def mark_drained_if_empty(buffer: Buffer, row: BufferLayout, started: datetime, using: str) -> None:
    """``row`` (``buffer``'s layout, retired) is drained if its shards hold nothing now: a
    complete flush of them started at ``started``."""
    if not shards_holding(buffer, list(range(buffer.shards))):
        mark_drained(row, started, using)


def due_shards(buffer: Buffer, other: BufferLayout) -> list[int]:
    """The shards of ``other`` that the flush of ``buffer`` drains now: none if it cannot
    reach them, every one until ``other`` is drained, then its exclusive shards that hold
    something again."""
    if not reachable(buffer, other):
        return []
    if is_drained(other):
        return shards_holding(buffer_of(buffer, other), exclusive_shards(buffer, other))
    return list(range(other.shards))


def complete(result: FlushResult) -> bool:
    """Did the flush of ``result`` drain every shard it was given of what it held at the start?"""
    return not (result.failed_shards or result.busy_shards or result.incomplete)


def add_to(result: FlushResult, part: FlushResult, other: BufferLayout) -> None:
    """Add what the drain of ``other`` (``part``) did to the flush's ``result``."""
    if part.batches or part.recovered or not complete(part):
        logger.warning("drained retired buffer layout %s: %s", other, part.summary())
    for name in ("batches", "keys", "deltas", "dropped", "recovered", "quarantined"):
        setattr(result, name, getattr(result, name) + getattr(part, name))
    result.already_applied += part.already_applied
    result.incomplete = result.incomplete or part.incomplete
    if part.failed_shards:
        logger.error(
            "could not drain shards %s of retired buffer layout %s: %s",
            sorted(part.failed_shards),
            other,
            part.failed_shards,
        )


def refuse_repairs(buffer: Buffer, using: str) -> None:
    """Raise :class:`LayoutChangePending` while a layout is not drained: reads miss its
    deltas, so a repair made now would count them twice once a flush applies them."""
    waiting = pending(buffer, using)
    if waiting:
        raise LayoutChangePending(waiting)


def status(buffer: Buffer, using: str, *, live: bool = True) -> dict[str, object]:
    """What ``counters_status`` shows: the layout in use and those not drained yet."""

    return {
        "current": describe_layout(buffer.prefix, buffer.shards, is_cluster(buffer)),
        "not_drained": pending(buffer, using, live=live),
    }
