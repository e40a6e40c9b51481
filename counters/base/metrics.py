"""Prometheus metrics of what happens in this process: flushes, direct writes, settled
pushes, repaired drift.

Each hook is one call from the code it observes (``metrics.fallback_written()``
in the write path, ``@metrics.observe_flush`` on the flush, ...) and never
raises: a metric that cannot be recorded is logged once, and the write or
flush goes on. What can be read at scrape time (backlog, lag, epochs, the
last flush) is not counted here but read from Redis and the DB by
:mod:`counters.ops.exposition`, which also serves the ``/metrics`` view.

Under a prefork server or Celery's prefork pool, set ``PROMETHEUS_MULTIPROC_DIR``
to a directory shared by the processes of one host and emptied before they
start: every process then writes its values there and the view adds them up
(``prometheus_client.multiprocess``). :func:`mark_process_dead` is called when
a process ends (Celery's ``worker_process_shutdown`` here, gunicorn's
``child_exit`` in ``config/gunicorn.py``), so the live gauges of dead
processes are dropped; counters and histograms keep what dead processes
counted.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS, DatabaseError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import multiprocess as prometheus_multiprocess

from counters.base.exceptions import BufferUnavailable, FlushFailed

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

#: The environment variable that turns on prometheus_client's multiprocess mode.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Prefix of every series Tally exposes.
PREFIX = "tally_"

#: Outcomes of a flush run (label ``outcome`` of ``tally_flush_runs_total``).
FLUSH_OUTCOMES = ("ok", "shards_failed", "redis_unavailable", "database_error", "error")
#: How a flush settled a direct write whose push may have arrived late.
LATE_PUSH_OUTCOMES = ("fenced", "taken_back")

#: The metrics of this process (in multiprocess mode their values also go to files).
REGISTRY = CollectorRegistry(auto_describe=True)

FLUSH_RUNS = Counter(
    "tally_flush_runs",
    "Flush runs of one database by outcome: ok; shards_failed (their batches stay in "
    "flight for the next run); redis_unavailable; database_error; error.",
    ["database", "outcome"],
    registry=REGISTRY,
)
FLUSH_DURATION = Histogram(
    "tally_flush_duration_seconds",
    "Seconds one flush run of one database took, from settling direct writes to "
    "recording its result (an automatic rebuild included).",
    ["database"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
FLUSH_IN_PROGRESS = Gauge(
    "tally_flush_in_progress",
    "Flush runs going on now in live processes.",
    ["database"],
    multiprocess_mode="livesum",
    registry=REGISTRY,
)
FLUSHED_BATCHES = Counter(
    "tally_flushed_batches",
    "Batches applied to the counter rows by flushes, each recorded in the ledger once.",
    ["database"],
    registry=REGISTRY,
)
FLUSHED_KEYS = Counter(
    "tally_flushed_keys",
    "Counter keys (rows) updated by flushed batches.",
    ["database"],
    registry=REGISTRY,
)
FLUSHED_DELTAS = Counter(
    "tally_flushed_deltas",
    "Sum of the absolute deltas applied by flushed batches.",
    ["database"],
    registry=REGISTRY,
)
RECOVERED_BATCHES = Counter(
    "tally_recovered_batches",
    "Batches a flush found in flight, left by a flusher that died or lost its lease: "
    "applied, or only cleared if the ledger had them.",
    ["database"],
    registry=REGISTRY,
)
DROPPED_KEYS = Counter(
    "tally_dropped_keys",
    "Buffered deltas a flush dropped because the row they count for is gone (its parent "
    "was deleted).",
    ["database"],
    registry=REGISTRY,
)
FALLBACK_WRITES = Counter(
    "tally_fallback_writes",
    "Direct writes of committed deltas to the counter rows, bypassing Redis: its push "
    "failed or was refused, or a delta is beyond exact Redis scores.",
    ["database"],
    registry=REGISTRY,
)
FALLBACK_KEYS = Counter(
    "tally_fallback_keys",
    "Counter keys (rows) updated by direct writes.",
    ["database"],
    registry=REGISTRY,
)
LATE_PUSHES = Counter(
    "tally_late_pushes",
    "Direct writes whose timed-out Redis push might still arrive, settled by a flush: "
    "fenced (the push can no longer apply) or taken_back (it had arrived; a compensating "
    "push took its deltas back).",
    ["database", "outcome"],
    registry=REGISTRY,
)
DRIFT_FOUND = Counter(
    "tally_drift_found",
    "Counter keys whose stored + buffered value differed from the truth, confirmed by "
    "consecutive readings (rebuilds, repairs, audits and dry runs).",
    ["database", "counter"],
    registry=REGISTRY,
)
DRIFT_REPAIRED = Counter(
    "tally_drift_repaired",
    "Counter keys repaired through the delta path after a confirmed drift.",
    ["database", "counter"],
    registry=REGISTRY,
)

OUTBOX_PUSHED = Counter(
    "tally_outbox_pushed",
    "Outbox rows (durable mode) the flush pushed itself: their writer died or could not "
    "push before COUNTERS_OUTBOX_GRACE.",
    ["database"],
    registry=REGISTRY,
)
OUTBOX_REPAIRED = Counter(
    "tally_outbox_repaired",
    "Outbox rows too old to push safely: their keys were queued for repair from the truth.",
    ["database"],
    registry=REGISTRY,
)

_failed_once = False


def _never_raises(func: Callable[P, None]) -> Callable[P, None]:
    """A hook that logs (once per process) instead of raising: metrics never break a write."""

    @functools.wraps(func)
    def hook(*args: P.args, **kwargs: P.kwargs) -> None:
        global _failed_once
        try:
            func(*args, **kwargs)
        except Exception:
            if not _failed_once:
                _failed_once = True
                logger.warning("could not record a metric (%s)", func.__name__, exc_info=True)

    return hook


@_never_raises
def fallback_written(using: str, keys: int) -> None:
    """A direct write of ``keys`` counter keys went to database ``using``."""
    FALLBACK_WRITES.labels(using).inc()
    FALLBACK_KEYS.labels(using).inc(keys)


@_never_raises
def late_push_settled(using: str, *, taken_back: bool) -> None:
    """A flush settled a direct write whose push had timed out: fenced, or taken back."""
    LATE_PUSHES.labels(using, "taken_back" if taken_back else "fenced").inc()


@_never_raises
def outbox_drained(using: str, pushed: int, repaired: int) -> None:
    """A flush pushed ``pushed`` outbox rows and queued ``repaired`` too old ones for repair."""
    if pushed:
        OUTBOX_PUSHED.labels(using).inc(pushed)
    if repaired:
        OUTBOX_REPAIRED.labels(using).inc(repaired)


@_never_raises
def drift(counter: str, found: int, repaired: int, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """``found`` keys of ``counter`` showed a confirmed drift; ``repaired`` were repaired."""
    if found:
        DRIFT_FOUND.labels(using, counter).inc(found)
    if repaired:
        DRIFT_REPAIRED.labels(using, counter).inc(repaired)


@_never_raises
def _flush_started(using: str) -> None:
    FLUSH_IN_PROGRESS.labels(using).inc()


class FlushCounts(Protocol):
    """What the metrics of a flush read of its result
    (:class:`~counters.flushing.result.FlushResult`)."""

    batches: int
    keys: int
    deltas: int
    recovered: int
    dropped: int


@_never_raises
def _flush_done(using: str, outcome: str, result: FlushCounts | None, seconds: float) -> None:
    FLUSH_IN_PROGRESS.labels(using).dec()
    FLUSH_RUNS.labels(using, outcome).inc()
    FLUSH_DURATION.labels(using).observe(seconds)
    if result is not None:
        FLUSHED_BATCHES.labels(using).inc(result.batches)
        FLUSHED_KEYS.labels(using).inc(result.keys)
        FLUSHED_DELTAS.labels(using).inc(result.deltas)
        RECOVERED_BATCHES.labels(using).inc(result.recovered)
        DROPPED_KEYS.labels(using).inc(result.dropped)


def observe_flush(func: Callable[P, R]) -> Callable[P, R]:
    """Decorate the flush of one database (``flush(using=alias, ...)``): time and count it.

    A call without ``using`` (every database) is passed through: the flush of
    each database it runs is observed by itself.
    """

    @functools.wraps(func)
    def observed(*args: P.args, **kwargs: P.kwargs) -> R:
        using = kwargs.get("using")
        if not isinstance(using, str):
            return func(*args, **kwargs)
        _flush_started(using)
        started = time.monotonic()
        outcome, result = "error", cast(Any, None)
        try:
            value = func(*args, **kwargs)
            outcome, result = "ok", value
            return value
        except FlushFailed as exc:
            outcome, result = "shards_failed", exc.result
            raise
        except BufferUnavailable:
            outcome = "redis_unavailable"
            raise
        except DatabaseError:
            outcome = "database_error"
            raise
        finally:
            _flush_done(using, outcome, result, time.monotonic() - started)

    return observed


def prepare(databases: Iterable[str], counters: Iterable[str]) -> None:
    """Create every known label set at 0, so that a series exists before its first event.

    ``rate()`` and ``increase()`` need a sample before the first increment to
    see it. Called by the view before each scrape.
    """
    databases, counters = list(databases), list(counters)
    for using in databases:
        for outcome in FLUSH_OUTCOMES:
            FLUSH_RUNS.labels(using, outcome)
        for outcome in LATE_PUSH_OUTCOMES:
            LATE_PUSHES.labels(using, outcome)
        for metric in (
            FLUSH_DURATION,
            FLUSH_IN_PROGRESS,
            FLUSHED_BATCHES,
            FLUSHED_KEYS,
            FLUSHED_DELTAS,
            RECOVERED_BATCHES,
            DROPPED_KEYS,
            FALLBACK_WRITES,
            FALLBACK_KEYS,
            OUTBOX_PUSHED,
            OUTBOX_REPAIRED,
        ):
            metric.labels(using)
        for counter in counters:
            DRIFT_FOUND.labels(using, counter)
            DRIFT_REPAIRED.labels(using, counter)


def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` if set (multiprocess mode), else None."""
    return os.environ.get(MULTIPROC_ENV) or None


def mark_process_dead(pid: int) -> None:
    """Drop the live gauges of process ``pid`` from the multiprocess directory (if any)."""
    path = multiprocess_dir()
    if path is not None:
        prometheus_multiprocess.mark_process_dead(pid, path)


def child_exited(pid: int | None = None, **kwargs: Any) -> None:
    """Receiver of Celery's ``worker_process_shutdown``, sent in a prefork child as it ends."""
    mark_process_dead(pid or os.getpid())


def worker_exited(**kwargs: Any) -> None:
    """Receiver of Celery's ``worker_shutdown``: the worker itself ran tasks (``--pool=solo``)."""
    mark_process_dead(os.getpid())
