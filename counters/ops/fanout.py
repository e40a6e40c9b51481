"""Parallel flush: one run of the periodic flush split over disjoint shard sets.

With ``COUNTERS_FLUSH_PARALLELISM`` = N > 1 the beat task ``counters.flush``
dispatches instead of flushing. For each database of
``counters.client.flushed_databases()``:

1. :func:`start_run` (in the dispatching task): settles the direct writes
   whose push may still arrive, sees new counters (:mod:`counters.read.backfill`)
   and prunes the ledger. This is work of the run
   as a whole, so it runs once, before any part starts, as it runs before the
   shards in a whole flush.
2. The dispatcher sends N ``counters.flush_shards`` tasks. Part ``i`` flushes
   shards ``i, i + N, i + 2N, …`` (:func:`partition`) with :func:`flush_part`:
   the flush engine on those shards only, each shard under its own lease, and
   then it records its result.
3. :func:`finish_run` (in the dispatching task, once the parts are sent):
   rebuilds the keys queued by reads below zero and, while a Redis data loss
   is unrepaired and ``COUNTERS_AUTO_REBUILD`` is on, runs the full rebuild,
   then that of the new counters still backfilling. All already run one at a
   time per key prefix, under the rebuild lease.

A part needs nothing from another part or from step 3. Exactly-once holds per
shard (lease and ledger), so a part that runs late, runs twice, or overlaps a
cron ``counters_flush`` skips the shards that are busy, or finds their batches
already applied. A part that never runs (its worker died, or it expired in
the queue) leaves its shards to the next run. A loss a part detects is
rebuilt by the dispatcher of a later run. A loss detected after that rebuild
started stays marked until the next full rebuild (see ``counters.flushing.epoch``).

The run is recorded in one Redis hash per prefix, ``<prefix>:flush_run``:
``id``, ``parts``, ``at``, ``dispatch:<id>`` (the dispatcher's result),
``part:<id>:<i>`` (each part's result, as JSON) and ``flushed_at`` (when a
part last recorded its result, of this run or an earlier one: the last-flush
time of ``/metrics``). Each part is observed by ``counters.base.metrics`` like a
whole flush. Fields carry the run id, so
a part of an older run that reports late cannot be taken for a part of the
current run. ``counters_status`` shows the newest run, whole or parallel
(:func:`last_run`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone
from redis import RedisError
from redis.exceptions import OutOfMemoryError
from redis.typing import EncodableT, FieldT

from counters.base import conf, metrics
from counters.base.exceptions import BufferUnavailable, FlushFailed
from counters.base.registry import all_specs
from counters.base.utils import to_str
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.flushing import layout, waits
from counters.flushing.lanes import flush_buffer
from counters.flushing.ledger import prune_ledger
from counters.flushing.result import FlushResult
from counters.flushing.settle import settle_fallbacks
from counters.ops.run import LAYOUT_PENDING_MESSAGE, added_up, needed_since, repair_and_rebuild
from counters.read import backfill
from counters.write import sender
from counters.write.durable import clear_applied, drain_outbox

logger = logging.getLogger(__name__)


def partition(shards: int, parts: int) -> list[list[int]]:
    """Shards ``0 … shards - 1`` dealt round-robin into ``min(parts, shards)`` disjoint lists.

    Every shard is in exactly one list and no list is empty. Raises
    ``ValueError`` unless both numbers are at least 1.
    """
    if shards < 1 or parts < 1:
        raise ValueError(f"need at least 1 shard and 1 part, got {shards} and {parts}")
    count = min(parts, shards)
    return [list(range(first, shards, count)) for first in range(count)]


#: Field of the run hash: when a part of this run or an earlier one last recorded its result.
FLUSHED_AT = "flushed_at"


def run_key(buffer: Buffer) -> str:
    """The hash recording the newest parallel run of ``buffer``'s prefix."""
    return f"{buffer.prefix}:flush_run"


@dataclass
class FlushRun:
    """One parallel run of one database, as the dispatcher sees it."""

    id: str
    using: str
    parts: list[list[int]]
    #: What the dispatcher itself did: late pushes taken back, keys repaired, rebuild state.
    result: FlushResult = field(default_factory=FlushResult)
    started: float = field(default_factory=time.monotonic)


def start_run(using: str, parallelism: int) -> FlushRun:
    """Settle direct writes, prune the ledger and record a new run of ``parallelism`` parts.

    What this process committed and still holds in its sender's queue is pushed
    first, as :func:`counters.ops.run.flush` does. Raises
    :class:`BufferUnavailable` when Redis cannot be reached; database errors
    propagate.
    """
    sender.push_queued(using)  # what this process committed is flushed too
    buffer = get_buffer(using)
    run = FlushRun(uuid.uuid4().hex[:16], using, partition(buffer.shards, parallelism))
    try:
        run.result.compensated = settle_fallbacks(buffer, using)
        drain_outbox(buffer, using)
        drain_layouts(buffer, run)
        backfill.see(all_specs(), using)  # before a part stores anything of a new counter
        prune_ledger(buffer, using, conf.ledger_retention())
        record: dict[FieldT, EncodableT] = {
            "id": run.id,
            "parts": len(run.parts),
            "at": time.time(),
        }
        flushed_at = buffer.client.hget(run_key(buffer), FLUSHED_AT)
        if flushed_at is not None:  # kept across runs: the last time any part flushed
            record[FLUSHED_AT] = flushed_at
        _write(buffer, record, replace=True)
        _record_dispatch(buffer, run)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_where(), exc) from exc
    return run


def drain_layouts(buffer: Buffer, run: FlushRun) -> None:
    """Before the parts are sent: retire other layouts, drain those this Redis holds."""
    layout.claim(buffer, run.using)
    layout.drain_retired(
        buffer,
        run.using,
        started=timezone.now(),
        deadline=time.monotonic() + conf.flush_time_budget(),
        batch_size=conf.batch_size(),
        lease_timeout=conf.lease_timeout(),
        result=run.result,
        own_shards_flushed=False,
    )
    run.result.layouts_pending = layout.pending(buffer, run.using)
    if run.result.layouts_pending:
        logger.error(LAYOUT_PENDING_MESSAGE, run.using, "; ".join(run.result.layouts_pending))


@metrics.observe_flush
def flush_part(
    *,
    using: str,
    shards: Iterable[int],
    run: str,
    index: int = 0,
    parts: int = 1,
    time_budget: float | None = None,
) -> FlushResult:
    """Flush ``shards`` of database ``using`` once, as part ``index`` of ``parts`` of ``run``.

    Only the shards: no settling, no repair, no rebuild (the dispatcher does
    those once per run). Each shard is flushed under its lease; busy ones are
    skipped. The result is recorded for ``counters_status`` under ``run``,
    and counted by ``counters.base.metrics`` as one flush run of ``using``.
    Raises :class:`BufferUnavailable` when Redis cannot be reached, and
    :class:`FlushFailed` (carrying the result) when some shards failed.
    """
    buffer = get_buffer(using)
    chosen = sorted(set(shards))
    budget = conf.flush_time_budget() if time_budget is None else time_budget
    try:
        with waits.session(using, waits.apply_limits(conf.lease_timeout(), budget)):
            result = flush_buffer(
                buffer,
                using=using,
                shards=chosen,
                batch_size=conf.batch_size(),
                time_budget=budget,
                lease_timeout=conf.lease_timeout(),
                retention=None,
            )
        clear_applied(buffer, using)  # durable mode: rows of pushes this part counted
        result.rebuild_needed_since = needed_since(buffer, using)
        record_part(buffer, run, index, parts, chosen, result)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_where(), exc) from exc
    if result.failed_shards:
        raise FlushFailed(result, result.failed_shards)
    return result


def finish_run(run: FlushRun) -> FlushResult:
    """The dispatcher's work after sending the parts: repair queued keys, maybe rebuild.

    Returns the dispatcher's result (``compensated``, ``repaired``,
    ``rebuild_needed_since``), also recorded for ``counters_status``.
    """
    buffer = get_buffer(run.using)
    result = run.result
    try:
        repair_and_rebuild(buffer, run.using, result, lambda: _record_dispatch(buffer, run))
        _record_dispatch(buffer, run)
    except RedisError as exc:
        raise BufferUnavailable(conf.redis_where(), exc) from exc
    return result


def record_part(
    buffer: Buffer, run: str, index: int, parts: int, shards: Sequence[int], result: FlushResult
) -> None:
    """Record the result of part ``index`` of ``run`` (a field of its own: no read-modify-write).

    Also sets ``flushed_at``, the time any part last recorded its result.
    """
    now = time.time()
    record = {
        "index": index,
        "parts": parts,
        "shards": list(shards),
        "at": now,
        "result": result.as_dict(),
    }
    _write(buffer, {f"part:{run}:{index}": json.dumps(record), FLUSHED_AT: json.dumps(now)})


def _record_dispatch(buffer: Buffer, run: FlushRun) -> None:
    run.result.seconds = time.monotonic() - run.started
    record = {"at": time.time(), "result": run.result.as_dict()}
    _write(buffer, {f"dispatch:{run.id}": json.dumps(record)})


def _write(buffer: Buffer, mapping: dict[FieldT, EncodableT], replace: bool = False) -> None:
    """HSET ``mapping`` into the run hash (after deleting it if ``replace``).

    Skipped with a log line when Redis is at maxmemory: draining it does not
    need this record.
    """
    key = run_key(buffer)
    try:
        if replace:
            buffer.client.delete(key)
        buffer.client.hset(key, mapping=mapping)
    except OutOfMemoryError:
        logger.warning("Redis is at maxmemory: flush run %s is not recorded", key)


def _result(data: dict[str, Any]) -> FlushResult:
    known = {f.name for f in dataclasses.fields(FlushResult)}
    return FlushResult(**{k: v for k, v in data.items() if k in known})


def last_run(buffer: Buffer) -> dict[str, Any] | None:
    """The newest parallel run of ``buffer``'s prefix, added up over what has reported.

    A dict of :class:`FlushResult` fields (the dispatcher's and the reported
    parts' results added up; ``seconds`` is the wall time from the dispatch to
    the last report), ``at`` (time of the last report, epoch seconds) and
    ``parallel``: ``{"run", "parts", "reported", "shards"}`` (``shards``: the
    shards of each reported part, by part index). None if no run is recorded.
    """
    raw = {to_str(k): to_str(v) for k, v in buffer.client.hgetall(run_key(buffer)).items()}
    run_id = raw.get("id")
    if not run_id:
        return None
    started = float(raw.get("at") or 0.0)
    records = [
        json.loads(value) for name, value in raw.items() if name.startswith(f"part:{run_id}:")
    ]
    records.sort(key=lambda record: record["index"])
    dispatch = raw.get(f"dispatch:{run_id}")
    results = [_result(record["result"]) for record in records]
    if dispatch is not None:
        results.insert(0, _result(json.loads(dispatch)["result"]))
    total = added_up(results) if results else FlushResult()
    reported_at = max((record["at"] for record in records), default=started)
    total.seconds = round(max(0.0, reported_at - started), 3) if records else 0.0
    data = total.as_dict()
    data["at"] = max(started, reported_at)
    data["parallel"] = {
        "run": run_id,
        "parts": int(raw.get("parts") or 0),
        "reported": len(records),
        "shards": {str(record["index"]): record["shards"] for record in records},
    }
    return data
