"""Deltas that cannot be applied: how a flush sets them aside, and putting them back or away.

A flush that finds a member it cannot apply on its own (a counter no longer
registered, a key its field cannot hold, a value beyond the column's range)
finds it by halving its batch (:func:`narrow_or_quarantine`) and moves it to
its shard's quarantine hash, so the rest of the shard keeps flowing. A
quarantined delta is not applied, and it is not lost: it stays part of its
counter's exact value (reads add the member's quarantined sum, and the audit
and the rebuild compare that value with the truth, so they never "repair"
it). Once the cause is fixed, :func:`retry` puts it back into the buffer
(``counters_flush --retry-quarantined``), which leaves the value as it is
until the flush applies it. :func:`discard` drops it for good
(``--discard-quarantined``): the value loses it, and where the truth says it
counted, the audit or a rebuild gives it back through the delta path.

Both are repairs: they run under the rebuild lease, inside a transaction
that checks its fencing token (:mod:`counters.flushing.fence`), so a retry or
discard that lost its lease changes nothing.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from counters.base.utils import capped, first_line
from counters.buffer import live
from counters.buffer.store import Batch, Buffer, Quarantined
from counters.flushing.fence import Fence, fenced
from counters.flushing.result import FlushResult

logger = logging.getLogger(__name__)

#: Examples shown per counter by the status.
EXAMPLES = 3

#: Longest error text logged or recorded for a failed shard or batch.
ERROR_LIMIT = 300


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


class BatchLost(Exception):
    """The batch in flight is no longer the one this flusher holds (its lease expired)."""


def narrow_or_quarantine(
    buffer: Buffer, batch: Batch, exc: Exception, result: FlushResult
) -> Batch | None:
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


def by_counter(entries: list[Quarantined], examples: int = EXAMPLES) -> dict[str, dict[str, Any]]:
    """{counter name: {count, sum, examples: [{member, delta, error, at, shard}]}}."""
    grouped: dict[str, dict[str, Any]] = {}
    for entry in entries:
        group = grouped.setdefault(entry.counter, {"count": 0, "sum": 0, "examples": []})
        group["count"] += 1
        group["sum"] += entry.delta
        if len(group["examples"]) < examples:
            group["examples"].append(
                {
                    "member": entry.member[:200],
                    "delta": entry.delta,
                    "error": entry.error,
                    "at": entry.at,
                    "shard": entry.shard,
                }
            )
    return dict(sorted(grouped.items()))


def _counters(entries: list[Quarantined]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for entry in entries:
        counts[entry.counter] += 1
    return ", ".join(f"{name[:100]} ({n})" for name, n in sorted(counts.items())[:20])


def retry(buffer: Buffer, fence: Fence) -> int:
    """Put every quarantined delta of ``buffer`` back into pending; returns how many.

    Each goes back at most once, even if this runs twice at once. A delta
    that fails again is quarantined again by the flush. Raises
    :class:`~counters.base.exceptions.RepairFenced` (nothing done) if ``fence`` is stale.
    """
    with fenced(fence):
        entries = buffer.quarantined()
        if not entries:
            return 0
        requeued, refused = buffer.requeue(entries)
    if requeued:
        logger.info(
            "retrying %s quarantined deltas of prefix %r: %s",
            requeued,
            buffer.prefix,
            _counters(entries),
        )
    if refused:
        logger.warning(
            "%s quarantined deltas stay quarantined: their pending sum would reach 2**53 (%s)",
            len(refused),
            _counters(refused),
        )
    return requeued


def discard(buffer: Buffer, fence: Fence) -> int:
    """Drop every quarantined delta of ``buffer`` for good; returns how many.

    Raises :class:`~counters.base.exceptions.RepairFenced` (nothing done) if ``fence`` is stale.
    """
    with fenced(fence):
        entries = buffer.quarantined()
        if not entries:
            return 0
        discarded = buffer.discard(entries)
    live.publish(buffer.client, buffer.prefix, buffer.shards, {e.member for e in entries})
    logger.warning(
        "discarded %s quarantined deltas of prefix %r (sum %+d): %s",
        discarded,
        buffer.prefix,
        sum(e.delta for e in entries),
        _counters(entries),
    )
    return discarded
