"""Drift: a key whose exact value (stored + buffered) differs from its truth, confirmed.

A write that has committed but not yet reached Redis looks like drift for a
moment, so one reading proves nothing. For each page of keys the exact value
is compared with the truth, read just before and just after it: a key whose
truth moved meanwhile is read again. A difference counts only once
``CONFIRM_READINGS`` readings in a row, each a delay longer than a commit
takes to reach Redis apart, showed the same one (:func:`confirm_drifts`); a
key that never gives such readings is reported as unstable, never guessed
at. The rebuild and the audit repair what this confirms.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from counters.base import conf
from counters.base.exceptions import CountersError
from counters.base.registry import CounterSpec, TruthSource
from counters.read import values as reads
from counters.write import outbox

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


def truth_source(spec: CounterSpec) -> TruthSource:
    """The truth source of ``spec``; raises :class:`NoTruthSource` if it has none."""
    if spec.source is None:
        raise NoTruthSource(spec.name)
    return spec.source


def _drifts(spec: CounterSpec, page: list[Any], using: str) -> tuple[dict[Any, Drift], set]:
    """The keys of ``page`` whose exact value differs from the truth, and the keys
    whose truth moved while they were read (their reading proves nothing).

    The truth is read before and after the exact value: a change committed in
    between (whose delta may or may not have reached Redis yet) shows as a
    moved truth, never as drift.
    """
    before = truth_source(spec).count_for(page, using=using)
    parts = reads.get_parts(spec.name, page, using=using)
    # Committed deltas still in the outbox (durable mode) and not in Redis are buffered
    # too: the flush pushes them later, so "repairing" them now would count them twice.
    # Those of rows too old to tell whether Redis has them prove nothing this time.
    held = outbox.held([spec.member(key) for key in page], using)
    after = truth_source(spec).count_for(page, using=using)
    drifts, moved = {}, set()
    for key in page:
        truth = int(before.get(key, 0))
        if truth != int(after.get(key, 0)) or spec.member(key) in held.unknown:
            moved.add(key)
            continue
        stored, pending = parts[key]
        pending += held.deltas.get(spec.member(key), 0)
        if stored + pending != truth:
            drifts[key] = Drift(key, stored, pending, truth)
    return drifts, moved


def sender_floor() -> float:
    """Least seconds between two readings of a suspect key with the per-process sender on.

    A commit may wait ``COUNTERS_SEND_DELAY_MS`` in a process's queue, then a
    socket timeout in its push before it falls back to the DB: readings closer
    than that could all miss it and "repair" a difference that is on its way.
    0 without the sender. Every process must share the setting.
    """
    delay = conf.send_delay()
    return delay + conf.socket_timeout() + 0.2 if delay > 0 else 0.0


def default_confirm_delay() -> float:
    """Seconds between two readings of a suspect key: longer than a commit takes to
    reach Redis, or to fall back to the DB after the Redis socket timeout, and never
    shorter than :func:`sender_floor`."""
    return max(2 * conf.socket_timeout() + 0.2, sender_floor())


def confirm_drifts(
    spec: CounterSpec,
    page: list[Any],
    *,
    confirm_delay: float,
    using: str,
    repair: Callable[[dict[Any, Drift]], None] | None = None,
) -> tuple[list[Drift], list[Any]]:
    """Read ``page`` and keep reading its suspect keys until each difference is confirmed.

    A difference is confirmed once ``CONFIRM_READINGS`` readings in a row,
    ``confirm_delay`` apart, showed the same one; ``repair`` (if given) is
    called at once with the differences each round confirmed. Returns the
    confirmed differences and the keys that kept changing for
    ``CONFIRM_ROUNDS`` rounds (nothing is known of them).
    """
    drifts, moved = _drifts(spec, page, using)
    # key -> (latest difference, how many readings in a row showed it)
    suspects: dict[Any, tuple[Drift | None, int]] = {k: (d, 1) for k, d in drifts.items()}
    suspects.update(dict.fromkeys(moved, (None, 0)))
    wrong: list[Drift] = []
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
        wrong.extend(confirmed.values())
        if confirmed and repair is not None:
            repair(confirmed)
        suspects = still
    return wrong, list(suspects)
