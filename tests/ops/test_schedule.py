"""The periodic flush exists after migrate and expires runs it missed."""

from __future__ import annotations

import pytest
from django_celery_beat.models import PeriodicTask

from counters.ops.schedule import (
    AUDIT_PERIODIC_TASK_NAME,
    AUDIT_TASK_NAME,
    PERIODIC_TASK_NAME,
    TASK_NAME,
    ensure_audit_task,
    ensure_periodic_task,
)

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


def test_periodic_audit_task_exists_after_migrate():
    task = PeriodicTask.objects.get(name=AUDIT_PERIODIC_TASK_NAME)
    assert (task.task, task.enabled) == (AUDIT_TASK_NAME, True)
    assert (task.interval.every, task.interval.period, task.expire_seconds) == (10, "seconds", 10)


def test_audit_interval_is_applied_and_0_turns_the_audit_off(settings):
    settings.COUNTERS_AUDIT_INTERVAL = 60
    ensure_audit_task()
    task = PeriodicTask.objects.get(name=AUDIT_PERIODIC_TASK_NAME)
    assert (task.interval.every, task.expire_seconds, task.enabled) == (60, 60, True)
    settings.COUNTERS_AUDIT_INTERVAL = 0
    assert ensure_audit_task() is None
    assert PeriodicTask.objects.get(name=AUDIT_PERIODIC_TASK_NAME).enabled is False
    settings.COUNTERS_AUDIT_INTERVAL = 30
    ensure_audit_task()
    task = PeriodicTask.objects.get(name=AUDIT_PERIODIC_TASK_NAME)
    assert (task.interval.every, task.enabled) == (30, True)
    assert PeriodicTask.objects.filter(task=AUDIT_TASK_NAME).count() == 1


def test_an_audit_interval_of_0_creates_no_entry(settings):
    PeriodicTask.objects.filter(name=AUDIT_PERIODIC_TASK_NAME).delete()
    settings.COUNTERS_AUDIT_INTERVAL = 0
    ensure_audit_task()
    assert not PeriodicTask.objects.filter(name=AUDIT_PERIODIC_TASK_NAME).exists()


def test_audit_task_is_registered_with_celery():
    from config.celery import app

    app.loader.import_default_modules()
    assert AUDIT_TASK_NAME in app.tasks
