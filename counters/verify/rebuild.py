"""Recompute counters from their source of truth and repair drift through the delta path.

Keys are read in keyset-paginated pages (never OFFSET), so memory and the
cost per page stay flat however many rows there are. For each page the exact
value (stored + buffered) is compared with the truth, read just before and
just after it: a key whose truth moved meanwhile proves nothing and is read
again. A write that has committed but not yet reached Redis looks like drift
for a moment, so a difference is repaired only once ``CONFIRM_READINGS``
readings in a row, each a delay longer than that apart, showed the same one
(:mod:`counters.verify.drift`): then ``truth - exact`` is added through
``add_many()`` like any other change.
Writers and flushers can keep running; a key that never gives such readings
is reported as unstable, never guessed at. Each repair runs in a transaction
that checks the rebuild's fencing token (:mod:`counters.flushing.fence`): a rebuild
that stalled past its lease while another repairer took over repairs
nothing more and raises :class:`~counters.base.exceptions.RepairFenced`.
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

from counters.base import conf, metrics
from counters.base.exceptions import BufferUnavailable, RebuildRunning, RepairFenced, UnknownCounter
from counters.base.registry import CounterSpec, all_specs, get_spec, parse_member
from counters.base.utils import batched
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.flushing import layout
from counters.flushing.epoch import clear_rebuild_needed
from counters.flushing.fence import Fence, fenced, take
from counters.read import backfill
from counters.verify.drift import (
    Drift,
    confirm_drifts,
    default_confirm_delay,
    truth_source,
)
from counters.verify.hold import rebuild_lease, wait_for_audit
from counters.write import negatives
from counters.write.add import add_many

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


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
    while page := truth_source(spec).keys_after(after, size, using=using):
        yield page
        after = page[-1]


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

    ``confirm_delay``: seconds between two readings of a suspect key; by default
    :func:`~counters.verify.drift.default_confirm_delay`, long enough for a commit on its
    way to reach Redis. A difference is repaired once
    :data:`~counters.verify.drift.CONFIRM_READINGS` readings in a row, that far apart, agree.

    Repairs are fenced by ``fence``, the token of the rebuild lease the caller
    holds; without one, a token of its own is taken before the first reading.
    Raises :class:`BufferUnavailable` if Redis is down (the exact values are
    unknown: a repair would be a guess), :class:`RepairFenced` once a newer
    repairer took over.
    """
    spec = get_spec(name)
    source = truth_source(spec)  # raises NoTruthSource
    if not dry_run:
        layout.refuse_repairs(get_buffer(using), using)
    confirm_delay = default_confirm_delay() if confirm_delay is None else confirm_delay
    # normalised, so "7" is compared with the truth of key 7
    keys = list(dict.fromkeys(map(spec.normalize, keys))) if keys is not None else None
    total = len(keys) if keys is not None else source.estimate(using=using)
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
    if keys is None and not dry_run and not report.unstable:
        backfill.mark_done(name, using)  # every key checked: a new counter is exact now
    return report


def repair_queued(buffer: Buffer, using: str = DEFAULT_DB_ALIAS, limit: int | None = None) -> int:
    """Rebuild up to ``limit`` keys that reads found below zero; returns how many were repaired.

    The keys wait in ``<prefix>:repair`` (see :mod:`counters.write.negatives`). Every
    key taken is removed from the queue, repaired or not: a key that kept
    changing during the rebuild is queued again by its next negative
    reading, and keys of counters without a truth source cannot be repaired
    (they are logged). Runs under the rebuild lease, so that no two repairs
    of one key overlap; returns 0 when a rebuild holds it.
    """
    key = negatives.queue_key(buffer)
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
    confirm_delay: float | None = None,
    progress: Progress | None = None,
) -> list[RebuildReport]:
    """Rebuild every registered counter that has a truth source: the full rebuild.

    ``batch_size`` and ``confirm_delay`` are :func:`rebuild`'s, for each counter.

    When it completes, the Redis data losses detected before it started are
    repaired, and their "rebuild needed" mark is cleared. Keys that kept
    changing are queued for the next flush to repair. Raises
    :class:`RebuildRunning` if another full rebuild or repair of this prefix
    is running, and :class:`RepairFenced` if this one outlived its lease and
    another repairer took over (the rebuild is then not complete).
    """

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
                        confirm_delay=confirm_delay,
                        progress=page_done,
                        using=using,
                        fence=lease.fence,
                    )
                    logger.info("full rebuild: %s", report.summary())
                    reports.append(report)
                    negatives.queue(buffer, spec.name, report.unstable)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_where(), exc) from exc
    if clear_rebuild_needed(buffer.prefix, started, using):
        logger.warning(
            "full rebuild complete: the Redis data loss of prefix %r is repaired", buffer.prefix
        )
    return reports


def rebuild_backfilling(
    using: str = DEFAULT_DB_ALIAS, *, confirm_delay: float | None = None
) -> list[RebuildReport]:
    """The full rebuild of each counter still backfilling (:mod:`counters.read.backfill`).

    Each one that completes with no key left unstable is exact from then on.
    ``confirm_delay`` is :func:`rebuild`'s. Runs under the rebuild lease like
    :func:`rebuild_all`: raises
    :class:`RebuildRunning` while another rebuild or repair holds it, and
    :class:`RepairFenced` if this one outlived it.
    """
    names = backfill.backfilling(using)
    if not names:
        return []
    buffer = get_buffer(using)
    try:
        with rebuild_lease(buffer, using) as lease:
            if not lease.held and not wait_for_audit(buffer, lease):
                raise RebuildRunning(lease.key)

            def page_done(done: int, total: int) -> None:
                if not lease.extend():
                    logger.warning("the rebuild lease %s expired during a backfill", lease.key)

            reports = []
            for name in names:
                report = rebuild(
                    name,
                    confirm_delay=confirm_delay,
                    progress=page_done,
                    using=using,
                    fence=lease.fence,
                )
                logger.warning("backfill of new counter %s: %s", name, report.summary())
                reports.append(report)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_where(), exc) from exc
    return reports
