from __future__ import annotations

import logging

from celery import shared_task

from . import api

logger = logging.getLogger(__name__)


@shared_task(name="counters.flush", ignore_result=True)
def flush_counters() -> dict:
    """Periodic flush (django-celery-beat). Overlapping runs are safe: leases."""
    result = api.flush()
    if result.batches or result.recovered or result.incomplete:
        logger.info("%s", result.summary())
    return result.as_dict()
