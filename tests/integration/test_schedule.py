"""The periodic flush exists after migrate and expires runs it missed."""

from __future__ import annotations

import pytest
from django_celery_beat.models import PeriodicTask

from counters.schedule import PERIODIC_TASK_NAME, TASK_NAME, ensure_periodic_task

pytestmark = pytest.mark.django_db


def test_periodic_flush_task_exists_after_migrate():
    task = PeriodicTask.objects.get(name=PERIODIC_TASK_NAME)
    assert task.task == TASK_NAME
    assert task.enabled
    assert (task.interval.every, task.interval.period) == (10, "seconds")
    assert task.expire_seconds == 10


def test_interval_setting_is_applied_on_the_next_migrate(settings):
    settings.COUNTERS_FLUSH_INTERVAL = 3
    ensure_periodic_task()
    task = PeriodicTask.objects.get(name=PERIODIC_TASK_NAME)
    assert (task.interval.every, task.expire_seconds) == (3, 3)
    assert PeriodicTask.objects.filter(task=TASK_NAME).count() == 1


def test_task_is_registered_with_celery():
    from config.celery import app

    app.loader.import_default_modules()
    assert TASK_NAME in app.tasks
