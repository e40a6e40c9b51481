"""Drift: a key whose exact value (stored + buffered) differs from its truth, confirmed.

A write that has committed but not yet reached Redis looks like drift for a
moment, so one reading proves nothing. For each page of keys the exact value
is compared with the truth, read just before and just after it: a key whose
truth moved meanwhile is read again. The rebuild and the audit repair what
:func:`confirm_drifts` confirms; a key that never gives a confirming pair of
readings is reported as unstable, never guessed at.

Without the per-process sender a commit reaches Redis (or the database) within
a socket timeout, and a difference counts once ``CONFIRM_READINGS`` readings in
a row, each a delay longer than that apart, showed the same one.

With the sender (``COUNTERS_SEND_DELAY_MS`` > 0) a commit may wait in its
process's queue for up to ``F`` = :func:`sender_floor` seconds, and a hot key
may always have some commit waiting: equal readings do not prove it quiet (a
+1 queued in one reading and a -1 in the next look the same). So the suspect
keys are marked in their shard's ``suspects`` hash, and every push counts
itself in the mark of each marked member it changes. A reading takes the
truth, then the marks' counts, then the exact value, then the truth again. A
difference seen in one reading is confirmed when the next reading, whose
counts are read at least ``F`` after the first reading's truth, shows the same
difference and the same counts. Proof: no push touched the key between the
two readings of the counts. Every commit made before the first reading's
second truth reached Redis within ``F``, so before the second counts, so
before the first counts: it is in the first exact value. A commit made after
the first counts could not be pushed before them, so none was made between
them and that truth. The first exact value holds exactly what
the truth counts, and its difference is real. (A commit that reaches the
database instead, by the fallback, changes the stored value: the second
reading then shows another difference.) A key touched in every window
stays unstable until it is quiet. A count that vanished (an expired or a
removed mark) proves nothing; a mark starts at a random number, so a mark
set again is never taken for the same one. The marks are removed after.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from counters.base import conf
from counters.base.exceptions import CountersError
from counters.base.registry import CounterSpec, TruthSource
from counters.client import get_buffer
from counters.read import values as reads
from counters.write import outbox

#: Readings in a row that must show the same difference before it is repaired.
CONFIRM_READINGS = 3
#: Readings of a suspect key after the first, before it is given up as still changing.
CONFIRM_ROUNDS = 8
#: How long a shard's marks of suspect keys live after the last confirming reading (ms).
SUSPECTS_TTL_MS = 300_000


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


def _drifts(
    spec: CounterSpec,
    page: list[Any],
    using: str,
    between: Callable[[], None] | None = None,
) -> tuple[dict[Any, Drift], set]:
    """The keys of ``page`` whose exact value differs from the truth, and the keys
    whose truth moved while they were read (their reading proves nothing).

    The truth is read before and after the exact value: a change committed in
    between (whose delta may or may not have reached Redis yet) shows as a
    moved truth, never as drift. ``between`` is called after the first truth,
    before the exact value.
    """
    before = truth_source(spec).count_for(page, using=using)
    if between is not None:
        between()
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

    Without the sender a difference is confirmed once ``CONFIRM_READINGS``
    readings in a row, ``confirm_delay`` apart, showed the same one; with it,
    once two readings at least :func:`sender_floor` apart showed the same one
    and no push touched the key between them (see the module). ``repair`` (if
    given) is called at once with the differences each round confirmed.
    Returns the confirmed differences and the keys that kept changing for
    ``CONFIRM_ROUNDS`` rounds (nothing is known of them).
    """
    drifts, moved = _drifts(spec, page, using)
    if sender_floor() > 0 and (drifts or moved):
        window = max(confirm_delay, sender_floor())
        return _confirm_quiet(spec, [*drifts, *moved], window, using, repair)
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


def _confirm_quiet(
    spec: CounterSpec,
    keys: list[Any],
    window: float,
    using: str,
    repair: Callable[[dict[Any, Drift]], None] | None,
) -> tuple[list[Drift], list[Any]]:
    """:func:`confirm_drifts` with the sender on: ``keys`` are marked, then read
    ``window`` apart; a difference is confirmed by two readings in a row that show
    it and the same counts of pushes (see the module)."""
    members = {key: spec.member(key) for key in keys}
    marks = Marks(using)
    # key -> (difference of the last reading or None, the counts read then)
    last: dict[Any, tuple[Drift | None, int | None]] = {}
    wrong: list[Drift] = []
    try:
        for _ in range(CONFIRM_ROUNDS):
            if not members:
                break
            marks.mark(members.values())
            time.sleep(window)
            again, moved, counts = _marked_reading(spec, members, marks, using)
            confirmed = {}
            for key, member in list(members.items()):
                if key not in moved and key not in again:
                    del members[key]  # exact: nothing to repair
                    continue
                drift = None if key in moved else again[key]
                before, seen = last.get(key, (None, None))
                last[key] = (drift, counts.get(member))
                quiet = seen is not None and seen == counts.get(member)
                if quiet and before is not None and drift is not None and _same(before, drift):
                    confirmed[key] = before
                    del members[key]
            wrong.extend(confirmed.values())
            if confirmed and repair is not None:
                repair(confirmed)
    finally:
        marks.remove()
    return wrong, list(members)


def _marked_reading(
    spec: CounterSpec, members: dict[Any, str], marks: Marks, using: str
) -> tuple[dict[Any, Drift], set, dict[str, int | None]]:
    """:func:`_drifts` of ``members``' keys, and their marks' counts read after the
    first truth, before the exact value."""
    counts: dict[str, int | None] = {}

    def read_counts() -> None:
        counts.update(marks.counts(members.values()))

    again, moved = _drifts(spec, list(members), using, read_counts)
    return again, moved, counts


def _same(before: Drift, drift: Drift) -> bool:
    """Whether two readings showed the same difference, against the same truth."""
    return (before.stored + before.pending, before.truth) == (
        drift.stored + drift.pending,
        drift.truth,
    )


class Marks:
    """Marks of suspect members in their shards' ``suspects`` hashes: each push that
    changes a marked member adds 1 to its mark (``counters/buffer/lua/push.lua``)."""

    def __init__(self, using: str) -> None:
        self.buffer = get_buffer(using)
        self.removable: set[str] = set()

    def _pipeline(self) -> Any:
        return self.buffer.client.pipeline(transaction=False)

    def mark(self, members: Iterable[str]) -> None:
        """Mark ``members`` where they are not marked, each at a random count."""
        pipe = self._pipeline()
        for shard, group in self.buffer.by_shard(members).items():
            key = self.buffer.key(shard, "suspects")
            for member in group:
                pipe.hsetnx(key, member, secrets.randbits(48))
            pipe.pexpire(key, SUSPECTS_TTL_MS)
            self.removable.update(group)
        pipe.execute()

    def counts(self, members: Iterable[str]) -> dict[str, int | None]:
        """The count of each of ``members``' marks; None where it is missing."""
        groups = self.buffer.by_shard(members)
        pipe = self._pipeline()
        for shard, group in groups.items():
            pipe.hmget(self.buffer.key(shard, "suspects"), group)
        out: dict[str, int | None] = {}
        for group, values in zip(groups.values(), pipe.execute(), strict=True):
            out.update(
                (m, None if v is None else int(v)) for m, v in zip(group, values, strict=True)
            )
        return out

    def remove(self) -> None:
        """Remove the marks this object set."""
        pipe = self._pipeline()
        for shard, group in self.buffer.by_shard(self.removable).items():
            pipe.hdel(self.buffer.key(shard, "suspects"), *group)
        self.removable.clear()
        pipe.execute()
