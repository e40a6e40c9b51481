"""Recompute counters from their source of truth and repair drift through the delta path.

Keys are read in keyset-paginated pages (never OFFSET), so memory and the
cost per page stay flat however many rows there are. For each page the exact
value (stored + buffered) is compared with the truth, read just before and
just after it: a key whose truth moved meanwhile proves nothing and is read
again. A write that has committed but not yet reached Redis looks like drift
for a moment, so a difference is repaired only once ``CONFIRM_READINGS``
readings in a row, each a delay longer than that apart, showed the same one:
then ``truth - exact`` is added through ``add_many()`` like any other change.
Writers and flushers can keep running; a key that never gives such readings
is reported as unstable, never guessed at.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from django.db import DEFAULT_DB_ALIAS

from . import api, conf, reads
from .exceptions import CountersError
from .registry import CounterSpec, get_spec
from .utils import batched

Progress = Callable[[int, int], None]

#: Readings in a row that must show the same difference before it is repaired.
CONFIRM_READINGS = 3
#: Readings of a suspect key after the first, before it is given up as still changing.
CONFIRM_ROUNDS = 8


class NoTruthSource(CountersError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"counter {name!r} has no truth source; it cannot be rebuilt")


@dataclass(frozen=True)
class Drift:
    key: Any
    stored: int
    pending: int
    truth: int

    @property
    def error(self) -> int:
        return self.stored + self.pending - self.truth


@dataclass
class RebuildReport:
    counter: str
    dry_run: bool
    checked: int = 0
    wrong: list[Drift] = field(default_factory=list)
    repaired: int = 0
    unstable: list[Any] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        verb = "found" if self.dry_run else "repaired"
        count = len(self.wrong) if self.dry_run else self.repaired
        text = (
            f"checked {self.checked} {self.counter} counters, {verb} {count} wrong "
            f"in {self.seconds:.1f}s"
        )
        if self.unstable:
            text += f"; {len(self.unstable)} kept changing, run again to check them"
        return text

    def as_dict(self) -> dict:
        data = asdict(self)
        data["wrong"] = [asdict(d) for d in self.wrong]
        return data


def _pages(
    spec: CounterSpec, keys: Iterable[Any] | None, size: int, using: str
) -> Iterator[list[Any]]:
    if keys is not None:
        yield from batched(keys, size)
        return
    after = None
    while page := spec.source.keys_after(after, size, using=using):
        yield page
        after = page[-1]


def _drifts(spec: CounterSpec, page: list[Any], using: str) -> tuple[dict[Any, Drift], set]:
    """The keys of ``page`` whose exact value differs from the truth, and the keys
    whose truth moved while they were read (their reading proves nothing).

    The truth is read before and after the exact value: a change committed in
    between (whose delta may or may not have reached Redis yet) shows as a
    moved truth, never as drift.
    """
    before = spec.source.count_for(page, using=using)
    parts = reads.get_parts(spec.name, page, using=using)
    after = spec.source.count_for(page, using=using)
    drifts, moved = {}, set()
    for key in page:
        truth = int(before.get(key, 0))
        if truth != int(after.get(key, 0)):
            moved.add(key)
            continue
        stored, pending = parts[key]
        if stored + pending != truth:
            drifts[key] = Drift(key, stored, pending, truth)
    return drifts, moved


def rebuild(
    name: str,
    *,
    keys: Iterable[Any] | None = None,
    dry_run: bool = False,
    batch_size: int = 1000,
    confirm_delay: float | None = None,
    progress: Progress | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> RebuildReport:
    """Check every key of counter ``name`` (or only ``keys``) and repair the wrong ones.

    Raises :class:`BufferUnavailable` if Redis is down: without the buffered
    deltas the exact values are unknown, and a repair would be a guess.
    """
    spec = get_spec(name)
    if spec.source is None:
        raise NoTruthSource(name)
    if confirm_delay is None:
        confirm_delay = 2 * conf.socket_timeout() + 0.2
    # normalised, so "7" is compared with the truth of key 7
    keys = list(dict.fromkeys(map(spec.normalize, keys))) if keys is not None else None
    total = len(keys) if keys is not None else spec.source.estimate(using=using)
    report = RebuildReport(counter=name, dry_run=dry_run)
    started = time.monotonic()
    for page in _pages(spec, keys, batch_size, using):
        drifts, moved = _drifts(spec, page, using)
        # key -> (latest difference, how many readings in a row showed it)
        suspects: dict[Any, tuple[Drift | None, int]] = {k: (d, 1) for k, d in drifts.items()}
        suspects.update(dict.fromkeys(moved, (None, 0)))
        for _ in range(CONFIRM_ROUNDS):
            if not suspects:
                break
            time.sleep(confirm_delay)
            again, moved = _drifts(spec, list(suspects), using)
            confirmed, still = {}, {}
            for key, (last, seen) in suspects.items():
                if key in moved:
                    still[key] = (last, seen)  # this reading proves nothing
                elif key in again:
                    drift = again[key]
                    same = last is not None and last.error == drift.error
                    seen = seen + 1 if same else 1
                    if seen >= CONFIRM_READINGS:
                        confirmed[key] = drift
                    else:
                        still[key] = (drift, seen)
            report.wrong.extend(confirmed.values())
            if confirmed and not dry_run:
                api.add_many(name, {k: -d.error for k, d in confirmed.items()}, using=using)
                report.repaired += len(confirmed)
            suspects = still
        report.unstable.extend(suspects)
        report.checked += len(page)
        if progress is not None:
            progress(report.checked, max(total, report.checked))
    report.seconds = time.monotonic() - started
    return report
