"""What a flush did: batches, keys and deltas applied, and every shard it could not flush.

One :class:`FlushResult` is filled by a flush of the buffer (:mod:`counters.flushing.lanes`),
the layout drain, the run entry and each part of a parallel run; ``summary()`` is
the one log line of a run, ``as_dict()`` what ``counters_status`` and
``/metrics`` read back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field


@dataclass
class FlushResult:
    """Counts of one flush, and the shards it found busy, behind the DB (lost) or failing."""

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


def added_up(results: list[FlushResult]) -> FlushResult:
    """One FlushResult of several: counts added, flags or-ed, shard lists merged.

    ``seconds`` is added up too: the caller of results that ran side by side sets it.
    """
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
