from __future__ import annotations

import logging

from celery import shared_task

from . import conf
from .epoch import REBUILD_COMMAND
from .exceptions import CountersError
from .flushing import flush_databases

logger = logging.getLogger(__name__)

#: Name of the periodic flush task (django-celery-beat's entry, see schedule.py).
TASK_NAME = "counters.flush"
#: Name of the periodic audit task (see schedule.py and audit.py).
AUDIT_TASK_NAME = "counters.audit"
#: Periodic tasks whose Celery "received" and "succeeded" lines go to DEBUG.
QUIET_TASKS = frozenset({TASK_NAME, AUDIT_TASK_NAME})


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


@shared_task(name=AUDIT_TASK_NAME, ignore_result=True)
def audit_counters() -> None:
    """Periodic audit (django-celery-beat) of every database of ``COUNTERS_DATABASES``.

    Does nothing while ``COUNTERS_AUDIT_INTERVAL`` is 0. Each repair is logged
    by the audit at WARNING; the task logs one line, at INFO when a run
    repaired something, at DEBUG otherwise. Redis being unreachable is one
    WARNING line: the audit needs the buffered deltas.
    """
    from .audit import audit_databases

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
