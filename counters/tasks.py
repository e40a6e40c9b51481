from __future__ import annotations

import logging

from celery import shared_task

from .epoch import REBUILD_COMMAND
from .flushing import flush_databases

logger = logging.getLogger(__name__)

#: Name of the periodic flush task (django-celery-beat's entry, see schedule.py).
TASK_NAME = "counters.flush"


class QuietFlushLog(logging.Filter):
    """Celery's own "received" and "succeeded" lines of the flush task, at DEBUG.

    The flush runs every few seconds; the task logs one line itself when a
    run did something. A record of this task at INFO is passed on as DEBUG
    if its logger shows DEBUG, and dropped otherwise. Other tasks' records,
    and failures, are left as they are.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if (
            record.levelno != logging.INFO
            or not isinstance(data, dict)
            or data.get("name") != TASK_NAME
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


@shared_task(name=TASK_NAME, ignore_result=True)
def flush_counters() -> None:
    """Periodic flush (django-celery-beat) of every database of ``counters.client.databases()``.

    Overlapping runs are safe: leases. Logs one line: at INFO when a run
    did something, at DEBUG when it was idle. While Redis data loss is
    unrepaired, each run logs an ERROR. Returns nothing, so that the worker
    has nothing to log or store per run.
    """
    results = flush_databases()
    busy = False
    parts = []
    for alias, result in results.items():
        work = (
            result.batches
            or result.recovered
            or result.incomplete
            or result.quarantined
            or result.compensated
            or result.repaired
        )
        busy = busy or bool(work)
        parts.append(f"{alias}: {result.summary()}" if len(results) > 1 else result.summary())
    logger.log(logging.INFO if busy else logging.DEBUG, "%s", "; ".join(parts))
    for alias, result in results.items():
        if result.rebuild_needed_since:
            logger.error(
                "counters of database %r are wrong since %s (Redis lost buffered deltas) "
                "until a full rebuild completes: run `%s`",
                alias,
                result.rebuild_needed_since,
                REBUILD_COMMAND,
            )
