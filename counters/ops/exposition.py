"""The ``/metrics`` view: Tally's series in the Prometheus text format, off unless
``COUNTERS_METRICS`` is on (then 404).

Two sources make up a scrape:

- what processes counted (:mod:`counters.base.metrics`): flush runs and their
  duration, batches and keys flushed, direct writes, settled late pushes,
  drift found and repaired. Without ``PROMETHEUS_MULTIPROC_DIR`` this is the
  serving process alone; with it, every process that shares the directory,
  added up.
- what the state is now (:class:`StateCollector`), read from Redis and the
  database at each scrape, the same readings as ``counters_status``: backlog
  and lag per shard, keys in flight, quarantine, the last flush, Redis data
  losses and "rebuild needed", direct writes still to settle. One reading
  serves every process, so none of these needs a multiprocess mode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from django.db import DatabaseError
from django.db.models import Sum
from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from redis import RedisError

from counters.base import conf, metrics
from counters.base.registry import all_specs
from counters.base.utils import first_line
from counters.client import flushed_databases, get_buffer
from counters.models import BufferEpoch, FlushBatch
from counters.ops import status
from counters.write.outbox import stats as outbox_stats

logger = logging.getLogger(__name__)


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


def outbox_state(using: str) -> tuple[int, float]:
    """(rows, seconds the oldest has waited; 0 when empty) of the outbox of database ``using``.

    Rows exist only in durable mode (``COUNTERS_DURABLE``), or just after it
    was turned off; the series are exposed in both modes (0 when empty).
    """
    return outbox_stats(using)


class _Families:
    """The scrape-time families, created on first use, yielded in creation order."""

    def __init__(self) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def add(
        self,
        kind: Callable[..., GaugeMetricFamily | CounterMetricFamily],
        name: str,
        documentation: str,
        labels: dict[str, str],
        value: float,
    ) -> None:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = kind(name, documentation, labels=list(labels))
        family.add_metric(list(labels.values()), value)

    def gauge(self, name: str, documentation: str, labels: dict[str, str], value: float) -> None:
        self.add(GaugeMetricFamily, name, documentation, labels, value)

    def counter(self, name: str, documentation: str, labels: dict[str, str], value: float) -> None:
        self.add(CounterMetricFamily, name, documentation, labels, value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


class StateCollector:
    """Backlog, lag, quarantine, last flush, epochs: read from Redis and the DB per scrape."""

    def __init__(self, aliases: Iterable[str] | None = None) -> None:
        self.aliases = list(aliases) if aliases is not None else None

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        for using in self.aliases if self.aliases is not None else flushed_databases():
            self._collect(using, families)
        yield from families

    def _collect(self, using: str, out: _Families) -> None:
        db = {"database": using}
        buffer = get_buffer(using)
        shards: list[dict[str, Any]] = []
        try:
            shards = status.shard_status(buffer, int(time.time() * 1000))
            last = status.flush_clock(buffer)
            pipe = buffer.client.pipeline(transaction=False)
            for shard in range(buffer.shards):
                pipe.hlen(buffer.key(shard, "quarantine"))
            quarantined = sum(int(n) for n in pipe.execute())
            queued = int(buffer.client.scard(f"{buffer.prefix}:repair"))
        except RedisError as exc:
            logger.warning("metrics: Redis is unreachable (%s)", first_line(exc, 200))
            out.gauge("tally_redis_up", "1 if Redis answered this scrape, else 0.", db, 0)
        else:
            out.gauge("tally_redis_up", "1 if Redis answered this scrape, else 0.", db, 1)
            self._collect_shards(shards, db, out)
            out.gauge(
                "tally_quarantined_deltas",
                "Buffered deltas that could not be applied, set aside with their error "
                "(counters_flush --retry-quarantined or --discard-quarantined).",
                db,
                quarantined,
            )
            out.gauge(
                "tally_repair_queue_keys",
                "Keys read below zero, queued for the next flush to rebuild.",
                db,
                queued,
            )
            if last is not None:
                out.gauge(
                    "tally_last_flush_timestamp_seconds",
                    "Unix time at which the last flush of this database recorded its result "
                    "(a whole flush, or a part of a parallel one).",
                    db,
                    last[0],
                )
                out.gauge(
                    "tally_last_flush_failed_shards",
                    "Shards the last flush could not flush (their batches stay in flight).",
                    db,
                    last[1],
                )
        self._collect_database(using, buffer, shards, out)

    def _collect_shards(
        self, shards: list[dict[str, Any]], db: dict[str, str], out: _Families
    ) -> None:
        """Backlog, lag and keys in flight of each shard."""
        for s in shards:
            labels = {**db, "shard": str(s["shard"])}
            out.gauge(
                "tally_backlog_keys",
                "Counter keys with buffered deltas waiting in the shard's pending set.",
                labels,
                s["pending_keys"],
            )
            out.gauge(
                "tally_lag_seconds",
                "Seconds since the shard's pending set last became non-empty: how long "
                "its oldest buffered delta has waited at most; 0 when empty.",
                labels,
                s["lag_seconds"],
            )
            out.gauge(
                "tally_inflight_keys",
                "Keys of the batch a flush moved out of the shard's pending set and has "
                "not acknowledged yet.",
                labels,
                s["inflight_keys"],
            )

    def _collect_database(
        self, using: str, buffer: Any, shards: list[dict[str, Any]], out: _Families
    ) -> None:
        db = {"database": using}
        try:
            epoch = status.epoch_status(buffer, shards, using)
            losses = BufferEpoch.objects.using(using).filter(prefix=buffer.prefix)
            lost = losses.aggregate(n=Sum("losses"))["n"] or 0
            unsettled = (
                FlushBatch.objects.using(using)
                .filter(kind=FlushBatch.Kind.FALLBACK, unsettled__isnull=False)
                .count()
            )
            outbox_rows, age = outbox_state(using)
        except DatabaseError as exc:
            logger.warning("metrics: database %r is unreachable (%s)", using, first_line(exc, 200))
            out.gauge("tally_database_up", "1 if the database answered this scrape.", db, 0)
            return
        out.gauge("tally_database_up", "1 if the database answered this scrape.", db, 1)
        out.counter(
            "tally_epoch_losses",
            "Redis data losses detected by the flush (an epoch marker gone, or Redis behind "
            "the batches the database applied), as recorded in the database.",
            db,
            lost,
        )
        out.gauge(
            "tally_rebuild_needed",
            "1 while a Redis data loss is not repaired by a full rebuild (counts are wrong "
            "until then), else 0.",
            db,
            1 if epoch["rebuild_needed"] else 0,
        )
        out.gauge(
            "tally_unsettled_fallbacks",
            "Direct writes whose timed-out push may still arrive, until a flush fences it.",
            db,
            unsettled,
        )
        out.gauge(
            "tally_outbox_oldest_age_seconds",
            "Seconds the oldest outbox row (durable mode) has waited to be pushed; 0 when "
            "empty. Above COUNTERS_OUTBOX_GRACE plus a flush interval, flushes are not "
            "draining it.",
            db,
            age,
        )
        out.gauge(
            "tally_outbox_rows",
            "Outbox rows (durable mode): committed transactions whose deltas are not "
            "acknowledged by Redis yet.",
            db,
            outbox_rows,
        )


class TallyOnly:
    """The families of ``collector`` whose names start with ``tally_``, without ``_created``.

    A ``_created`` sample is the time a process first counted a series:
    multiprocess mode cannot add those up and leaves them out, so a
    single process leaves them out too, and both modes show the same series.
    """

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        for family in self.collector.collect():
            if family.name.startswith(metrics.PREFIX):
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family


def registry(aliases: Iterable[str] | None = None) -> CollectorRegistry:
    """A registry of everything one scrape shows, for ``prometheus_client.generate_latest``.

    ``aliases``: the databases to read (default: those a flush drains).
    """
    aliases = list(aliases) if aliases is not None else flushed_databases()
    metrics.prepare(aliases, [spec.name for spec in all_specs()])
    scrape = CollectorRegistry(auto_describe=False)
    path = metrics.multiprocess_dir()
    processes: Collector = (
        MultiProcessCollector(None, path) if path is not None else metrics.REGISTRY
    )
    scrape.register(TallyOnly(processes))
    scrape.register(StateCollector(aliases))
    return scrape


@never_cache
@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics``: the Prometheus exposition, or 404 unless ``COUNTERS_METRICS`` is on."""
    if not conf.metrics_enabled():
        raise Http404("metrics are off (COUNTERS_METRICS)")
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    body = encoder(registry())
    return HttpResponse(b"" if request.method == "HEAD" else body, content_type=content_type)
