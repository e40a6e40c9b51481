"""Celery tasks: the periodic flush, and the parts a parallel flush is split into.

``counters.flush`` is the task of the beat entry (see schedule.py). With
``COUNTERS_FLUSH_PARALLELISM`` 1 it flushes every shard of every database
itself. With N > 1 it dispatches: per database it settles the direct writes,
sends N ``counters.flush_shards`` tasks that flush disjoint shard sets on
whichever workers take them, then repairs queued keys and runs the automatic
rebuild (see :mod:`counters.ops.fanout`). ``counters.audit`` is the periodic audit (see
:mod:`counters.verify.audit`).
"""

from __future__ import annotations

import logging
import random

from celery import shared_task
from django.db import DatabaseError

from counters.base import conf
from counters.base.exceptions import BufferUnavailable, CountersError
from counters.base.utils import first_line
from counters.client import flushed_databases
from counters.flushing.epoch import REBUILD_COMMAND
from counters.flushing.result import FlushResult
from counters.ops.fanout import FlushRun, finish_run, flush_part, start_run
from counters.ops.run import flush_databases
from counters.verify.audit import audit_databases

logger = logging.getLogger(__name__)

#: Name of the periodic flush task (django-celery-beat's entry, see schedule.py).
TASK_NAME = "counters.flush"
#: Name of the task that flushes one part (a shard set) of a parallel run.
PART_TASK_NAME = "counters.flush_shards"
#: Name of the periodic audit task (see schedule.py and audit.py).
AUDIT_TASK_NAME = "counters.audit"
#: Tasks whose Celery "received" and "succeeded" lines are logged at DEBUG.
QUIET_TASKS = frozenset({TASK_NAME, PART_TASK_NAME, AUDIT_TASK_NAME})


class QuietFlushLog(logging.Filter):
    """Celery's own "received" and "succeeded" lines of the flush and audit tasks, at DEBUG.

    They run every few seconds; each task logs one line itself when a run
    did something. A record of this task at INFO is passed on as DEBUG
    if its logger shows DEBUG, and dropped otherwise. Other tasks' records,
    and failures, are left as they are.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if (
            record.levelno != logging.INFO
            or not isinstance(data, dict)
            or data.get("name") not in QUIET_TASKS
        ):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def quiet_celery_log() -> None:
    """Install :class:`QuietFlushLog` on the Celery loggers that log each task run."""
    for name in ("celery.app.trace", "celery.worker.strategy"):
        celery_logger = logging.getLogger(name)
        if not any(isinstance(f, QuietFlushLog) for f in celery_logger.filters):
            celery_logger.addFilter(QuietFlushLog())


quiet_celery_log()


def did_work(result: FlushResult) -> bool:
    return bool(
        result.batches
        or result.recovered
        or result.incomplete
        or result.quarantined
        or result.compensated
        or result.repaired
    )


@shared_task(name=TASK_NAME, ignore_result=True)
def flush_counters() -> None:
    """Periodic flush (django-celery-beat) of every database of :func:`flushed_databases`.

    With ``COUNTERS_FLUSH_PARALLELISM`` > 1, sends that many
    ``counters.flush_shards`` tasks per database instead (:func:`dispatch`).
    Overlapping runs are safe: leases. Logs one line: at INFO when a run
    did something, at DEBUG when it was idle. While Redis data loss is
    unrepaired, each run logs an ERROR. Returns nothing, so that the worker
    has nothing to log or store per run.
    """
    parallelism = conf.flush_parallelism()
    if parallelism > 1:
        dispatch(parallelism)
        return
    results = flush_databases()
    busy = False
    parts = []
    for alias, result in results.items():
        busy = busy or did_work(result)
        parts.append(f"{alias}: {result.summary()}" if len(results) > 1 else result.summary())
    logger.log(logging.INFO if busy else logging.DEBUG, "%s", "; ".join(parts))
    for alias, result in results.items():
        log_rebuild_needed(alias, result)


def dispatch(parallelism: int) -> list[FlushRun]:
    """One parallel run: per database, settle, send the parts, then repair and maybe rebuild.

    Every database's parts are sent before any database's repair or rebuild
    starts (a rebuild can take minutes). A database that fails does not keep
    the others from their run; the first error is raised again at the end.
    Redis being unreachable stops at once. Returns the runs started.
    """
    runs: list[FlushRun] = []
    error: Exception | None = None
    aliases = flushed_databases()
    expires = conf.flush_interval()  # like the beat entry: a part not started by then is dropped
    for alias in aliases:
        try:
            run = start_run(alias, parallelism)
        except BufferUnavailable:
            raise
        except DatabaseError as exc:
            logger.error("flush run of database %r failed: %s", alias, first_line(exc, 300))
            error = error or exc
            continue
        send_parts(run, expires)
        runs.append(run)
    for run in runs:
        try:
            result = finish_run(run)
        except BufferUnavailable:
            raise
        except DatabaseError as exc:
            logger.error("flush run of database %r failed: %s", run.using, first_line(exc, 300))
            error = error or exc
            continue
        where = f" of database {run.using!r}" if len(aliases) > 1 else ""
        logger.log(
            logging.INFO if did_work(result) else logging.DEBUG,
            "run %s%s: %s parts sent; %s late pushes taken back, %s queued keys repaired",
            run.id,
            where,
            len(run.parts),
            result.compensated,
            result.repaired,
        )
        log_rebuild_needed(run.using, result)
    if error is not None:
        raise error
    return runs


def send_parts(run: FlushRun, expires: float) -> None:
    """Send one ``counters.flush_shards`` task per part of ``run``, expiring after ``expires`` s.

    From a random part on: when fewer workers than parts are free and parts
    expire, it is not always the same shards that wait for the next run.
    """
    first = random.randrange(len(run.parts))
    for index in [*range(first, len(run.parts)), *range(first)]:
        flush_shards.apply_async(
            kwargs={
                "using": run.using,
                "shards": run.parts[index],
                "run": run.id,
                "index": index,
                "parts": len(run.parts),
            },
            expires=expires,
        )


@shared_task(name=PART_TASK_NAME, ignore_result=True)
def flush_shards(using: str, shards: list[int], run: str, index: int = 0, parts: int = 1) -> None:
    """Flush ``shards`` of database ``using``: part ``index`` of ``parts`` of parallel run ``run``.

    Sent by :func:`dispatch`. Logs one line (INFO with work, DEBUG idle). A
    part whose shards failed records its result, then raises
    :class:`~counters.base.exceptions.FlushFailed` (Celery logs it, like a failed
    whole flush); their batches stay in flight for the next run.
    """
    result = flush_part(using=using, shards=shards, run=run, index=index, parts=parts)
    logger.log(
        logging.INFO if did_work(result) else logging.DEBUG,
        "part %s/%s of run %s (database %r, shards %s): %s",
        index + 1,
        parts,
        run,
        using,
        shards,
        result.summary(),
    )


def log_rebuild_needed(alias: str, result: FlushResult) -> None:
    if result.rebuild_needed_since:
        logger.error(
            "counters of database %r are wrong since %s (Redis lost buffered deltas) "
            "until a full rebuild completes: run `%s`",
            alias,
            result.rebuild_needed_since,
            REBUILD_COMMAND,
        )


@shared_task(name=AUDIT_TASK_NAME, ignore_result=True)
def audit_counters() -> None:
    """Periodic audit (django-celery-beat) of every database of ``COUNTERS_DATABASES``.

    Does nothing while ``COUNTERS_AUDIT_INTERVAL`` is 0. Each repair is logged
    by the audit at WARNING; the task logs one line, at INFO when a run
    repaired something, at DEBUG otherwise. Redis being unreachable is one
    WARNING line: the audit needs the buffered deltas.
    """
    if not conf.audit_interval():
        logger.debug("the periodic audit is off (COUNTERS_AUDIT_INTERVAL is 0)")
        return
    try:
        results = audit_databases()
    except CountersError as exc:
        logger.warning("audit skipped: %s", exc)
        return
    busy = any(r.repaired for r in results.values())
    parts = [
        f"{alias}: {r.summary()}" if len(results) > 1 else r.summary()
        for alias, r in results.items()
    ]
    logger.log(logging.INFO if busy else logging.DEBUG, "%s", "; ".join(parts))
