from __future__ import annotations

import logging

from celery import shared_task

from . import api
from .epoch import REBUILD_COMMAND

logger = logging.getLogger(__name__)


@shared_task(name="counters.flush", ignore_result=True)
def flush_counters() -> dict:
    """Periodic flush (django-celery-beat). Overlapping runs are safe: leases."""
    result = api.flush()
    if result.batches or result.recovered or result.incomplete:
        logger.info("%s", result.summary())
    if result.rebuild_needed_since:
        logger.error(
            "counters are wrong since %s (Redis lost buffered deltas) until a full rebuild "
            "completes: run `%s`",
            result.rebuild_needed_since,
            REBUILD_COMMAND,
        )
    return result.as_dict()
