"""Deltas that cannot be applied: what the quarantine holds, and putting it back or away.

A flush that finds a member it cannot apply on its own (a counter no longer
registered, a key its field cannot hold, a value beyond the column's range)
moves it to its shard's quarantine hash (see ``flusher.isolate``), so the
rest of the shard keeps flowing. A quarantined delta is neither applied nor
counted by reads, and it is not lost: once the cause is fixed,
:func:`retry` puts it back into the buffer (``counters_flush
--retry-quarantined``); :func:`discard` drops it for good
(``--discard-quarantined``), which is right after a full rebuild of its
counter has repaired the count anyway.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from .buffer import Buffer, Quarantined

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


def retry(buffer: Buffer) -> int:
    """Put every quarantined delta of ``buffer`` back into pending; returns how many.

    Each goes back at most once, even if this runs twice at once. A delta
    that fails again is quarantined again by the flush.
    """
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


def discard(buffer: Buffer) -> int:
    """Drop every quarantined delta of ``buffer`` for good; returns how many."""
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
