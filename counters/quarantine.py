"""Deltas that cannot be applied: what the quarantine holds, and putting it back or away.

A flush that finds a member it cannot apply on its own (a counter no longer
registered, a key its field cannot hold, a value beyond the column's range)
moves it to its shard's quarantine hash (see ``flusher.isolate``), so the
rest of the shard keeps flowing. A quarantined delta is not applied, and it
is not lost: it stays part of its counter's exact value (reads add the
member's quarantined sum, and the audit and the rebuild compare that value
with the truth, so they never "repair" it). Once the cause is fixed,
:func:`retry` puts it back into the buffer (``counters_flush
--retry-quarantined``), which leaves the value as it is until the flush
applies it. :func:`discard` drops it for good (``--discard-quarantined``):
the value loses it, and where the truth says it counted, the audit or a
rebuild gives it back through the delta path.

Both are repairs: they run under the rebuild lease, inside a transaction
that checks its fencing token (:mod:`counters.fence`), so a retry or
discard that lost its lease changes nothing.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from .buffer import Buffer, Quarantined
from .fence import Fence, fenced

logger = logging.getLogger(__name__)

#: Examples shown per counter by the status.
EXAMPLES = 3


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
    :class:`~counters.exceptions.RepairFenced` (nothing done) if ``fence`` is stale.
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

    Raises :class:`~counters.exceptions.RepairFenced` (nothing done) if ``fence`` is stale.
    """
    with fenced(fence):
        entries = buffer.quarantined()
        if not entries:
            return 0
        discarded = buffer.discard(entries)
    logger.warning(
        "discarded %s quarantined deltas of prefix %r (sum %+d): %s",
        discarded,
        buffer.prefix,
        sum(e.delta for e in entries),
        _counters(entries),
    )
    return discarded
