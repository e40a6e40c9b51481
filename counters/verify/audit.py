"""The continuous audit: a bounded slice of keys per run compared with the truth, drift repaired.

Each run takes, for every counter that has a truth source, the next
``COUNTERS_AUDIT_SLICE`` keys after that counter's cursor, in the keyset
order of its truth source (``keys_after``), in pages of at most
:data:`PAGE` keys, and repairs a difference between the exact value (stored
+ buffered) and the truth only once confirmed (:mod:`counters.verify.drift`).
The repair is ``truth - stored - buffered`` added through ``add_many()``,
the delta path, logged and recorded (:class:`~counters.models.AuditRepair`)
in the same transaction. When a run reaches the last key, the sweep is
complete and the next run starts again from the first key.

The cursor of each counter is a row of :class:`~counters.models.AuditCursor`
in the database the counter lives in: it survives a Redis that loses its
data (the moment drift is most likely), each database alias has its own,
and the admin shows it. A run holds the rebuild lease of the alias's key
prefix (:mod:`counters.verify.hold`), so it never overlaps a full rebuild, a
repair of keys read below zero, or another audit; a run that finds the lease
taken does nothing. Its repairs check the lease's fencing token in their
transaction (:mod:`counters.flushing.fence`): a run that stalled past its lease
while another repairer took over stops, having repaired nothing more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError
from django.utils import timezone
from redis import RedisError

from counters.base import conf, metrics
from counters.base.exceptions import BufferUnavailable, InvalidKey, RepairFenced
from counters.base.registry import CounterSpec, all_specs, get_spec
from counters.base.utils import first_line
from counters.buffer.store import Buffer
from counters.client import flushed_databases, get_buffer
from counters.flushing import layout
from counters.flushing.fence import Fence, fenced
from counters.models import AuditCursor, AuditRepair
from counters.verify.drift import (
    Drift,
    NoTruthSource,
    confirm_drifts,
    default_confirm_delay,
    sender_floor,
    truth_source,
)
from counters.verify.hold import AuditHold, LeaseLost
from counters.write.add import add_many

logger = logging.getLogger(__name__)

#: Most keys read in one statement; a larger slice is checked page by page.
PAGE = 1000
#: Repairs logged one by one per counter and run; the rest in one line.
LOGGED_REPAIRS = 10
#: Longest key text kept in a repair record or a cursor.
KEY_LENGTH = 255


@dataclass
class CounterAudit:
    """What one run did for one counter."""

    counter: str
    checked: int = 0
    first: Any = None
    last: Any = None
    sweep_done: bool = False  # this run reached the last key: the next one starts over
    sweeps: int = 0
    repaired: list[Drift] = field(default_factory=list)
    unstable: list[Any] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "counter": self.counter,
            "checked": self.checked,
            "first": self.first,
            "last": self.last,
            "sweep_done": self.sweep_done,
            "sweeps": self.sweeps,
            "repaired": [
                {"key": d.key, "stored": d.stored, "buffered": d.pending, "truth": d.truth}
                for d in self.repaired
            ],
            "unstable": list(self.unstable),
        }


@dataclass
class AuditResult:
    """What one audit run of one database alias did."""

    using: str
    counters: list[CounterAudit] = field(default_factory=list)
    skipped: str | None = None  # why the run did nothing (another audit or a rebuild runs)
    stopped: str | None = None  # why the run stopped early (its lease was lost)
    seconds: float = 0.0

    @property
    def checked(self) -> int:
        return sum(c.checked for c in self.counters)

    @property
    def repaired(self) -> int:
        return sum(len(c.repaired) for c in self.counters)

    @property
    def unstable(self) -> int:
        return sum(len(c.unstable) for c in self.counters)

    def summary(self) -> str:
        if self.skipped:
            return f"audit skipped: {self.skipped}"
        n = len(self.counters)
        text = (
            f"audited {self.checked} keys of {n} counter{'' if n == 1 else 's'}, "
            f"repaired {self.repaired} in {self.seconds:.3f}s"
        )
        if self.unstable:
            text += f"; {self.unstable} kept changing (checked again next sweep)"
        done = [c.counter for c in self.counters if c.sweep_done]
        if done:
            text += f"; sweep complete: {', '.join(done)}"
        if self.stopped:
            text += f"; stopped early: {self.stopped}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "using": self.using,
            "skipped": self.skipped,
            "stopped": self.stopped,
            "seconds": round(self.seconds, 6),
            "checked": self.checked,
            "repaired": self.repaired,
            "unstable": self.unstable,
            "counters": [c.as_dict() for c in self.counters],
        }


def audited_specs(names: list[str] | None = None) -> list[CounterSpec]:
    """The counters an audit checks: every one with a truth source, or those ``names``."""
    if names is None:
        return [spec for spec in all_specs() if spec.source is not None]
    specs = [get_spec(name) for name in dict.fromkeys(names)]
    for spec in specs:
        if spec.source is None:
            raise NoTruthSource(spec.name)
    return specs


def audit(
    using: str = DEFAULT_DB_ALIAS,
    *,
    names: list[str] | None = None,
    slice_size: int | None = None,
    confirm_delay: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> AuditResult:
    """One audit run of database ``using``: the next slice of keys of every audited counter.

    ``progress(done, total)`` is called after each page of keys checked: ``total`` is
    the slice of every counter, and a counter whose sweep ends early counts as done.

    ``slice_size`` defaults to ``COUNTERS_AUDIT_SLICE``, ``confirm_delay`` to
    the rebuild's (``2 * COUNTERS_SOCKET_TIMEOUT + 0.2`` s), and is never
    shorter than a commit may wait in a sender's queue
    (``COUNTERS_SEND_DELAY_MS`` plus the socket timeout and 0.2 s). Raises
    :class:`BufferUnavailable` when Redis cannot be reached: without the
    buffered deltas the exact values are unknown. Returns with ``skipped``
    set, having done nothing, when a rebuild or another audit of the same key
    prefix is running.
    """
    specs = audited_specs(names)
    slice_size = conf.audit_slice() if slice_size is None else slice_size
    if slice_size < 1:
        raise ValueError(f"the audit slice must be at least 1 key (got {slice_size})")
    if confirm_delay is None:
        confirm_delay = default_confirm_delay()
    # Never shorter than a commit may wait in a sender's queue (and its push).
    confirm_delay = max(confirm_delay, sender_floor())
    result = AuditResult(using=using)
    started = time.monotonic()
    buffer = get_buffer(using)
    try:
        _audit_slices(buffer, result, specs, slice_size, confirm_delay, progress)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_where(), exc) from exc
    finally:
        result.seconds = time.monotonic() - started
    return result


def _audit_slices(
    buffer: Buffer,
    result: AuditResult,
    specs: list[CounterSpec],
    slice_size: int,
    confirm_delay: float,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """The body of :func:`audit`: each counter's next slice, under the rebuild lease."""
    total = slice_size * len(specs)

    def step(done: int) -> None:
        if progress is not None:
            progress(min(done, total), total)

    def counter_step(before: int) -> Callable[[int], None]:
        """A counter's pages: ``before`` keys of the counters before it, then its own."""
        return lambda checked: step(before + checked)

    using, waiting = result.using, layout.pending(buffer, result.using)
    if waiting:  # reads miss those deltas: a repair now would count them twice
        result.skipped = f"buffer layouts not drained yet: {'; '.join(waiting)}"
        return
    with AuditHold(buffer, using) as hold:
        lease = hold.lease
        if not lease.held:
            result.skipped = f"a rebuild or another audit holds {lease.key}"
            return
        try:
            for i, spec in enumerate(specs):
                report = CounterAudit(spec.name)
                result.counters.append(report)
                before = i * slice_size
                _audit_counter(
                    spec,
                    report,
                    slice_size,
                    confirm_delay,
                    hold,
                    using,
                    counter_step(before),
                )
                step(before + slice_size)
        except LeaseLost:
            result.stopped = f"the lease {lease.key} expired"
            logger.warning("audit of %r stopped: its lease %s expired", using, lease.key)
        except RepairFenced as exc:
            result.stopped = f"the lease {lease.key} was lost: {exc}"
            logger.warning("audit of %r stopped: %s", using, exc)
        if any(c.sweep_done for c in result.counters):
            _prune(using)


def audit_databases(*, slice_size: int | None = None) -> dict[str, AuditResult]:
    """One audit run of each database of ``COUNTERS_DATABASES``; {alias: AuditResult}.

    A database that fails does not keep the others from being audited; the
    first error is raised once all have run. Redis unreachable stops at once.
    """
    results: dict[str, AuditResult] = {}
    error: Exception | None = None
    aliases = flushed_databases()
    for alias in aliases:
        try:
            results[alias] = audit(alias, slice_size=slice_size)
        except BufferUnavailable:
            raise
        except DatabaseError as exc:
            if len(aliases) > 1:
                logger.error("audit of database %r failed: %s", alias, first_line(exc, 300))
            error = error or exc
    if error is not None:
        raise error
    return results


def _position(spec: CounterSpec, cursor: AuditCursor) -> Any:
    """The cursor's last key as the key field's value; None at the start of a sweep."""
    if cursor.after is None:
        return None
    try:
        return spec.normalize(cursor.after)
    except InvalidKey as exc:  # the key field changed type since: start the sweep again
        logger.warning("audit of %s: cursor %r dropped (%s)", spec.name, cursor.after[:100], exc)
        return None


def _start_sweep(cursor: AuditCursor) -> None:
    cursor.after = None
    cursor.checked = 0
    cursor.sweep_started_at = timezone.now()


def _end_sweep(cursor: AuditCursor, report: CounterAudit) -> None:
    now = timezone.now()
    cursor.sweeps += 1
    cursor.last_sweep_at = now
    started = cursor.sweep_started_at
    cursor.last_sweep_seconds = (now - started).total_seconds() if started else None
    cursor.after = None
    report.sweep_done = True


def _audit_counter(
    spec: CounterSpec,
    report: CounterAudit,
    slice_size: int,
    confirm_delay: float,
    hold: AuditHold,
    using: str,
    page_done: Callable[[int], None],
) -> None:
    source = truth_source(spec)
    cursor, _ = AuditCursor.objects.using(using).get_or_create(counter=spec.name)
    after = _position(spec, cursor)
    if after is None:
        _start_sweep(cursor)
    restarted = False
    remaining = slice_size
    try:
        while remaining > 0:
            limit = min(PAGE, remaining)
            page = source.keys_after(after, limit, using=using)
            if not page and after is not None and not restarted and report.checked == 0:
                # The last run stopped on the last key: this run completes the sweep
                # and checks the first slice of the next one.
                _end_sweep(cursor, report)
                _start_sweep(cursor)
                after, restarted = None, True
                continue
            if page:
                _check_page(spec, page, report, confirm_delay, hold.fence, using)
                if report.first is None:
                    report.first = page[0]
                report.last = after = page[-1]
                cursor.after = str(after)[:KEY_LENGTH]
                cursor.checked += len(page)
                remaining -= len(page)
                page_done(report.checked)
            if len(page) < limit:
                _end_sweep(cursor, report)
                break
            hold.extend()
    finally:
        cursor.last_run_at = timezone.now()
        cursor.save(using=using)
        report.sweeps = cursor.sweeps


def _check_page(
    spec: CounterSpec,
    page: list[Any],
    report: CounterAudit,
    confirm_delay: float,
    fence: Fence,
    using: str,
) -> None:
    def repair(confirmed: dict[Any, Drift]) -> None:
        layout.refuse_repairs(get_buffer(using), using)  # a layout changed during the run
        record_repairs(spec, list(confirmed.values()), using, fence)
        report.repaired.extend(confirmed.values())

    _, unstable = confirm_drifts(
        spec, page, confirm_delay=confirm_delay, using=using, repair=repair
    )
    report.checked += len(page)
    report.unstable.extend(unstable)


def record_repairs(spec: CounterSpec, drifts: list[Drift], using: str, fence: Fence) -> None:
    """Repair ``drifts`` through the delta path, recorded and logged.

    The repair records and the deltas belong to one transaction, which
    checks ``fence`` first (raising :class:`RepairFenced`, nothing changed,
    when a newer repairer took over): the deltas are sent after its COMMIT
    like every other change.
    """
    rows = [
        AuditRepair(
            counter=spec.name,
            key=str(d.key)[:KEY_LENGTH],
            stored=d.stored,
            buffered=d.pending,
            truth=d.truth,
        )
        for d in drifts
    ]
    with fenced(fence):
        AuditRepair.objects.using(using).bulk_create(rows)
        add_many(spec.name, {d.key: -d.error for d in drifts}, using=using)
    metrics.drift(spec.name, len(drifts), len(drifts), using=using)
    for d in drifts[:LOGGED_REPAIRS]:
        logger.warning(
            "audit repaired %s %s: stored %s + buffered %s, truth %s (%+d)",
            spec.name,
            str(d.key)[:100],
            d.stored,
            d.pending,
            d.truth,
            -d.error,
        )
    if len(drifts) > LOGGED_REPAIRS:
        logger.warning("audit repaired %s more keys of %s", len(drifts) - LOGGED_REPAIRS, spec.name)


def _prune(using: str) -> None:
    cutoff = timezone.now() - timedelta(seconds=conf.audit_retention())
    AuditRepair.objects.using(using).filter(repaired_at__lt=cutoff).delete()
