"""The periodic flush and audit tasks in django-celery-beat, created by ``migrate``."""

from __future__ import annotations

import logging
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, router

from counters.base import conf

logger = logging.getLogger(__name__)

TASK_NAME = "counters.flush"
PERIODIC_TASK_NAME = "counters: flush buffered deltas"
AUDIT_TASK_NAME = "counters.audit"
AUDIT_PERIODIC_TASK_NAME = "counters: audit counters against their truth"


def ensure_periodic_task(interval: int | None = None, using: str = DEFAULT_DB_ALIAS):
    """Create or update the beat entry that runs the flush every ``interval`` seconds.

    Each run expires after one interval, so runs missed while no worker was up
    are dropped instead of piling up in the broker.
    """
    if not apps.is_installed("django_celery_beat"):
        return None
    # An optional app, and models: imported only once it is known to be installed.
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every = interval or conf.flush_interval()
    schedule, _ = IntervalSchedule.objects.using(using).get_or_create(
        every=every, period=IntervalSchedule.SECONDS
    )
    task, created = PeriodicTask.objects.using(using).update_or_create(
        name=PERIODIC_TASK_NAME,
        defaults={
            "task": TASK_NAME,
            "interval": schedule,
            "expire_seconds": every,
            "enabled": True,
            "description": "Drains the Redis buffer of the counters app into the DB.",
        },
    )
    if created:
        logger.info("created periodic task %r every %ss", PERIODIC_TASK_NAME, every)
    return task


def ensure_periodic_task_after_migrate(using: str = DEFAULT_DB_ALIAS, **kwargs: Any) -> None:
    """Create the beat entry when ``migrate`` runs on the database that holds it.

    django-celery-beat's tables live where the routers send PeriodicTask;
    ``migrate --database <other alias>`` leaves the entry alone.
    """
    if not apps.is_installed("django_celery_beat"):
        return
    # An optional app, and models: imported only once it is known to be installed.
    from django_celery_beat.models import PeriodicTask

    if using != router.db_for_write(PeriodicTask):
        return
    ensure_periodic_task(using=using)


def ensure_audit_task(interval: int | None = None, using: str = DEFAULT_DB_ALIAS):
    """Create or update the beat entry that runs the audit every ``interval`` seconds.

    ``interval`` defaults to ``COUNTERS_AUDIT_INTERVAL``; 0 disables the entry
    (it is not created if it does not exist). Each run expires after one
    interval, like the flush's.
    """
    if not apps.is_installed("django_celery_beat"):
        return None
    # An optional app, and models: imported only once it is known to be installed.
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    every = conf.audit_interval() if interval is None else interval
    tasks = PeriodicTask.objects.using(using)
    if every <= 0:
        if tasks.filter(name=AUDIT_PERIODIC_TASK_NAME, enabled=True).update(enabled=False):
            logger.info("disabled periodic task %r", AUDIT_PERIODIC_TASK_NAME)
        return None
    schedule, _ = IntervalSchedule.objects.using(using).get_or_create(
        every=every, period=IntervalSchedule.SECONDS
    )
    task, created = tasks.update_or_create(
        name=AUDIT_PERIODIC_TASK_NAME,
        defaults={
            "task": AUDIT_TASK_NAME,
            "interval": schedule,
            "expire_seconds": every,
            "enabled": True,
            "description": (
                "Compares a slice of the counters with their truth and repairs confirmed drift."
            ),
        },
    )
    if created:
        logger.info("created periodic task %r every %ss", AUDIT_PERIODIC_TASK_NAME, every)
    return task


def ensure_audit_task_after_migrate(using: str = DEFAULT_DB_ALIAS, **kwargs: Any) -> None:
    """Create the audit's beat entry when ``migrate`` runs on the database that holds it."""
    if not apps.is_installed("django_celery_beat"):
        return
    # An optional app, and models: imported only once it is known to be installed.
    from django_celery_beat.models import PeriodicTask

    if using != router.db_for_write(PeriodicTask):
        return
    ensure_audit_task(using=using)


def _beat_entries(task: str) -> list[str]:
    """How Celery beat runs ``task``: one description per enabled entry (none: not at all).

    Reads django-celery-beat's enabled ``PeriodicTask`` rows and the static
    ``CELERY_BEAT_SCHEDULE`` setting; a missing table (beat's migrations not run)
    counts as no entry.
    """
    found = []
    schedule = getattr(settings, "CELERY_BEAT_SCHEDULE", None) or {}
    for entry in schedule.values():
        if isinstance(entry, dict) and entry.get("task") == task:
            every = entry.get("schedule")
            found.append(f"every {every:g}s" if isinstance(every, int | float) else "on a schedule")
    if apps.is_installed("django_celery_beat"):
        from django_celery_beat.models import PeriodicTask

        rows = PeriodicTask.objects.using(router.db_for_read(PeriodicTask))
        try:
            for every, period in rows.filter(task=task, enabled=True).values_list(
                "interval__every", "interval__period"
            ):
                found.append(
                    f"every {every}s" if period == "seconds" and every else "on a schedule"
                )
        except DatabaseError:  # the table is not there: nothing schedules it through beat
            pass
    return found


def schedule_status() -> dict[str, Any]:
    """Whether Celery beat runs the flush and the audit, and how often.

    ``{"flush": {"beat": [...]}, "audit": {"beat": [...], "interval": N}}``: ``beat`` lists
    the enabled beat entries (``"every 10s"``), empty when nothing in beat runs the task (then
    cron must: ``manage.py counters_flush``, ``manage.py counters_audit``).
    """
    return {
        "flush": {"beat": _beat_entries(TASK_NAME)},
        "audit": {"beat": _beat_entries(AUDIT_TASK_NAME), "interval": conf.audit_interval()},
    }
