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
is reported as unstable, never guessed at. Each repair runs in a transaction
that checks the rebuild's fencing token (:mod:`counters.fence`): a rebuild
that stalled past its lease while another repairer took over repairs
nothing more and raises :class:`~counters.exceptions.RepairFenced`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from django.db import DEFAULT_DB_ALIAS
from django.utils import timezone
from redis import RedisError

from . import conf, layout, metrics, outbox, reads, repair
from .buffer import Buffer
from .client import get_buffer
from .exceptions import (
    BufferUnavailable,
    CountersError,
    RebuildRunning,
    RepairFenced,
    UnknownCounter,
)
from .fence import Fence, RepairLease, fenced, take
from .lease import Lease
from .registry import CounterSpec, TruthSource, all_specs, get_spec, parse_member
from .utils import batched
from .writes import add_many

logger = logging.getLogger(__name__)

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


def _source(spec: CounterSpec) -> TruthSource:
    if spec.source is None:
        raise NoTruthSource(spec.name)
    return spec.source


def _pages(
    spec: CounterSpec, keys: Iterable[Any] | None, size: int, using: str
) -> Iterator[list[Any]]:
    if keys is not None:
        yield from batched(keys, size)
        return
    after = None
    while page := _source(spec).keys_after(after, size, using=using):
        yield page
        after = page[-1]


def _drifts(spec: CounterSpec, page: list[Any], using: str) -> tuple[dict[Any, Drift], set]:
    """The keys of ``page`` whose exact value differs from the truth, and the keys
    whose truth moved while they were read (their reading proves nothing).

    The truth is read before and after the exact value: a change committed in
    between (whose delta may or may not have reached Redis yet) shows as a
    moved truth, never as drift.
    """
    before = _source(spec).count_for(page, using=using)
    parts = reads.get_parts(spec.name, page, using=using)
    # Committed deltas still in the outbox (durable mode) are buffered too: the flush
    # pushes them later, so "repairing" them now would count them twice.
    held = outbox.pending([spec.member(key) for key in page], using)
    after = _source(spec).count_for(page, using=using)
    drifts, moved = {}, set()
    for key in page:
        truth = int(before.get(key, 0))
        if truth != int(after.get(key, 0)):
            moved.add(key)
            continue
        stored, pending = parts[key]
        pending += held.get(spec.member(key), 0)
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


def rebuild(
    name: str,
    *,
    keys: Iterable[Any] | None = None,
    dry_run: bool = False,
    batch_size: int = 1000,
    confirm_delay: float | None = None,
    progress: Progress | None = None,
    using: str = DEFAULT_DB_ALIAS,
    fence: Fence | None = None,
) -> RebuildReport:
    """Check every key of counter ``name`` (or only ``keys``) and repair the wrong ones.

    Repairs are fenced by ``fence``, the token of the rebuild lease the
    caller holds; without one, a token of its own is taken before the first
    reading. Raises :class:`BufferUnavailable` if Redis is down: without the
    buffered deltas the exact values are unknown, and a repair would be a
    guess. Raises :class:`RepairFenced` once a newer repairer took over.
    """
    spec = get_spec(name)
    if spec.source is None:
        raise NoTruthSource(name)
    if not dry_run:
        layout.refuse_repairs(get_buffer(using), using)
    if confirm_delay is None:
        confirm_delay = default_confirm_delay()
    # normalised, so "7" is compared with the truth of key 7
    keys = list(dict.fromkeys(map(spec.normalize, keys))) if keys is not None else None
    total = len(keys) if keys is not None else spec.source.estimate(using=using)
    report = RebuildReport(counter=name, dry_run=dry_run)
    started = time.monotonic()
    if fence is None and not dry_run:
        fence = take(get_buffer(using).prefix, using)

    def repair(confirmed: dict[Any, Drift]) -> None:
        assert fence is not None
        layout.refuse_repairs(get_buffer(using), using)  # a layout changed during the run
        with fenced(fence):
            add_many(name, {k: -d.error for k, d in confirmed.items()}, using=using)
        report.repaired += len(confirmed)

    for page in _pages(spec, keys, batch_size, using):
        wrong, unstable = confirm_drifts(
            spec,
            page,
            confirm_delay=confirm_delay,
            using=using,
            repair=None if dry_run else repair,
        )
        report.wrong.extend(wrong)
        report.unstable.extend(unstable)
        report.checked += len(page)
        if progress is not None:
            progress(report.checked, max(total, report.checked))
    report.seconds = time.monotonic() - started
    metrics.drift(name, len(report.wrong), report.repaired, using=using)
    return report


def rebuild_lease(buffer: Buffer, using: str = DEFAULT_DB_ALIAS) -> RepairLease:
    """The lease that keeps full rebuilds, repairs and audits of one prefix from overlapping.

    Two of them confirming the same drift at once would both repair it. The
    lease outlives one page of a rebuild (its confirmation rounds included)
    and is extended after each page. Taking it takes a fencing token in
    database ``using`` (``lease.fence``), which the holder's repairs check:
    a holder that outlived its lease repairs nothing.
    """
    page = CONFIRM_ROUNDS * default_confirm_delay()
    return RepairLease(
        buffer.client,
        f"{buffer.prefix}:rebuild",
        conf.lease_timeout() + page,
        prefix=buffer.prefix,
        using=using,
    )


def audit_holder_key(buffer: Buffer) -> str:
    """Holds the rebuild lease's token while an audit run holds that lease."""
    return f"{buffer.prefix}:rebuild:audit"


def wait_for_audit(buffer: Buffer, lease: Lease) -> bool:
    """Take ``lease`` once the audit run that holds it ends; False if something else holds it.

    An audit run holds the rebuild lease for a moment every few seconds: a
    rebuild that starts meanwhile waits for it (at most one lease time)
    instead of failing.
    """
    deadline = time.monotonic() + lease.ttl_ms / 1000
    while time.monotonic() < deadline:
        if lease.acquire():
            return True
        holder = buffer.client.get(lease.key)
        if holder is not None and holder != buffer.client.get(audit_holder_key(buffer)):
            return False  # a rebuild or a repair holds it
        time.sleep(0.05)
    return lease.acquire()


def repair_queued(buffer: Buffer, using: str = DEFAULT_DB_ALIAS, limit: int | None = None) -> int:
    """Rebuild up to ``limit`` keys that reads found below zero; returns how many were repaired.

    The keys wait in ``<prefix>:repair`` (see :mod:`counters.repair`). Every
    key taken is removed from the queue, repaired or not: a key that kept
    changing during the rebuild is queued again by its next negative
    reading, and keys of counters without a truth source cannot be repaired
    (they are logged). Runs under the rebuild lease, so that no two repairs
    of one key overlap; returns 0 when a rebuild holds it.
    """
    key = repair.queue_key(buffer)
    if not buffer.client.exists(key) or layout.pending(buffer, using):
        return 0  # nothing queued, or a layout change not drained: the keys wait
    with rebuild_lease(buffer, using) as lease:
        if not lease.held:
            return 0  # a rebuild is running; the keys wait for the next flush
        raw = cast(list[bytes], buffer.client.srandmember(key, limit or conf.batch_size()))
        if not raw:
            return 0
        by_counter: dict[str, dict[Any, bytes]] = {}
        for member in raw:
            try:
                spec, counter_key = parse_member(member)
            except (UnknownCounter, ValueError, TypeError) as exc:
                logger.warning("dropping unknown repair entry %r: %s", member[:200], exc)
                continue
            if spec.source is None:
                logger.warning(
                    "counter %s has no truth source; cannot repair %r", spec.name, member
                )
                continue
            by_counter.setdefault(spec.name, {})[counter_key] = member
        repaired = 0
        try:
            for name, members in by_counter.items():
                report = rebuild(name, keys=list(members), using=using, fence=lease.fence)
                repaired += report.repaired
                if report.wrong or report.unstable:
                    logger.warning("repair of keys read below zero: %s", report.summary())
        except RepairFenced:
            return repaired  # another repairer took over: the keys stay queued
        buffer.client.srem(key, *raw)
        return repaired


def rebuild_all(
    using: str = DEFAULT_DB_ALIAS,
    *,
    batch_size: int = 1000,
    progress: Progress | None = None,
) -> list[RebuildReport]:
    """Rebuild every registered counter that has a truth source: the full rebuild.

    When it completes, the Redis data losses detected before it started are
    repaired, and their "rebuild needed" mark is cleared. Keys that kept
    changing are queued for the next flush to repair. Raises
    :class:`RebuildRunning` if another full rebuild or repair of this prefix
    is running, and :class:`RepairFenced` if this one outlived its lease and
    another repairer took over (the rebuild is then not complete).
    """
    from .epoch import clear_rebuild_needed

    buffer = get_buffer(using)
    try:
        with rebuild_lease(buffer, using) as lease:
            if not lease.held and not wait_for_audit(buffer, lease):
                raise RebuildRunning(lease.key)

            def page_done(done: int, total: int) -> None:
                if not lease.extend():
                    logger.warning("the rebuild lease %s expired during a rebuild", lease.key)
                if progress is not None:
                    progress(done, total)

            started = timezone.now()
            reports = []
            for spec in all_specs():
                if spec.source is not None:
                    report = rebuild(
                        spec.name,
                        batch_size=batch_size,
                        progress=page_done,
                        using=using,
                        fence=lease.fence,
                    )
                    logger.info("full rebuild: %s", report.summary())
                    reports.append(report)
                    repair.queue(buffer, spec.name, report.unstable)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_url(), exc) from exc
    if clear_rebuild_needed(buffer.prefix, started, using):
        logger.warning(
            "full rebuild complete: the Redis data loss of prefix %r is repaired", buffer.prefix
        )
    return reports
