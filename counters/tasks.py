from __future__ import annotations

import logging

from celery import shared_task

from . import api
from .epoch import REBUILD_COMMAND

logger = logging.getLogger(__name__)


@shared_task(name="counters.flush", ignore_result=True)
def flush_counters() -> dict:
    """Periodic flush (django-celery-beat) of every database of ``api.databases()``.

    Overlapping runs are safe: leases. Returns {alias: result as a dict}. While
    Redis data loss is unrepaired, each run logs an ERROR.
    """
    results = api.flush_databases()
    for alias, result in results.items():
        if result.batches or result.recovered or result.incomplete:
            logger.info("%s: %s", alias, result.summary())
        if result.rebuild_needed_since:
            logger.error(
                "counters of database %r are wrong since %s (Redis lost buffered deltas) "
                "until a full rebuild completes: run `%s`",
                alias,
                result.rebuild_needed_since,
                REBUILD_COMMAND,
            )
    return {alias: result.as_dict() for alias, result in results.items()}
