"""The periodic flush task logs one line a run: INFO with work, DEBUG when idle; Celery's
own per-run lines of it (received, succeeded with the return value) stay at DEBUG."""

from __future__ import annotations

import logging

import pytest
from celery.app import trace
from celery.worker import strategy

from counters import tasks
from notifications.models import Notification
from tests.helpers import stored

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def task_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "counters.tasks"]


def test_an_idle_run_logs_at_debug_only(caplog):
    with caplog.at_level(logging.DEBUG, logger="counters.tasks"):
        assert tasks.flush_counters() is None
    [record] = task_records(caplog)
    assert record.levelno == logging.DEBUG
    assert record.getMessage().startswith("flushed 0 batches, 0 keys, 0 deltas in ")


def test_a_run_with_work_logs_one_info_line(make_user, caplog):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    with caplog.at_level(logging.DEBUG, logger="counters.tasks"):
        assert tasks.flush_counters() is None
    [record] = task_records(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith("flushed 1 batches, 1 keys, 1 deltas in ")
    assert stored(alice) == 1


def celery_lines(name: str) -> None:
    """What a Celery worker logs for one run of task ``name``."""
    context = {"id": "abc", "name": name, "args": "()", "kwargs": "{}", "eta": None}
    strategy.logger.info(trace.LOG_RECEIVED, context, extra={"data": context})
    done = {"id": "abc", "name": name, "return_value": "None", "runtime": 0.01, "args": ""}
    trace.info(trace.LOG_SUCCESS, done)


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        pytest.param(logging.INFO, [], id="info"),
        pytest.param(logging.DEBUG, [logging.DEBUG, logging.DEBUG], id="debug"),
    ],
)
def test_celery_lines_of_the_flush_task_are_debug(caplog, level, expected):
    with (
        caplog.at_level(level, logger="celery.app.trace"),
        caplog.at_level(level, logger="celery.worker.strategy"),
    ):
        celery_lines(tasks.TASK_NAME)
    assert [r.levelno for r in caplog.records if r.name.startswith("celery.")] == expected


def test_celery_lines_of_other_tasks_are_left_alone(caplog):
    with (
        caplog.at_level(logging.INFO, logger="celery.app.trace"),
        caplog.at_level(logging.INFO, logger="celery.worker.strategy"),
    ):
        celery_lines("someone.else")
    records = [r for r in caplog.records if r.name.startswith("celery.")]
    assert [(r.name, r.levelno) for r in records] == [
        ("celery.worker.strategy", logging.INFO),
        ("celery.app.trace", logging.INFO),
    ]
