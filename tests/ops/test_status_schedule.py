"""``counters_status``: the lag counts only what is pending, and the schedule says what runs
the flush and the audit (Celery beat's entries, or cron when beat runs neither)."""

from __future__ import annotations

import time
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import transaction
from django_celery_beat.models import PeriodicTask

import counters
from counters.client import get_buffer
from counters.ops.schedule import AUDIT_TASK_NAME, TASK_NAME, schedule_status
from counters.ops.status import gather

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def status_text() -> list[str]:
    out = StringIO()
    call_command("counters_status", stdout=out)
    return out.getvalue().splitlines()


def test_no_lag_when_nothing_is_pending(make_user):
    alice = make_user()
    with transaction.atomic():
        counters.add("unread", alice.pk, +1)
    with transaction.atomic():
        counters.add("unread", alice.pk, -1)  # the member's sum is 0: removed
    counters.push_queued()
    buffer = get_buffer()
    shard = buffer.shard_of(f"unread:{alice.pk}")
    assert not buffer.client.exists(buffer.key(shard, "since"))  # the empty shard's mark too
    status = gather(buffer)
    assert status["totals"] == {"pending_keys": 0, "inflight_batches": 0, "max_lag_seconds": 0.0}
    assert ": 0 pending keys, 0 batches in flight, max lag 0.0s" in status_text()[0]

    with transaction.atomic():
        counters.add("unread", alice.pk, +1)
    counters.push_queued()
    time.sleep(0.05)  # the mark is the push's time, in milliseconds
    assert gather(buffer)["shards"][shard]["lag_seconds"] >= 0.05  # pending again: it lags


def test_status_names_celery_beat_when_its_entries_run_the_flush_and_the_audit():
    assert schedule_status() == {
        "flush": {"beat": ["every 10s"]},
        "audit": {"beat": ["every 10s"], "interval": 10},
    }
    lines = status_text()
    assert "flush: every 10s by Celery beat" in lines
    assert any(line.startswith("audit: every 10s by Celery beat, ") for line in lines), lines


def test_status_says_cron_when_nothing_schedules_the_flush_or_the_audit(settings):
    PeriodicTask.objects.filter(task=TASK_NAME).delete()
    PeriodicTask.objects.filter(task=AUDIT_TASK_NAME).update(enabled=False)
    assert schedule_status() == {"flush": {"beat": []}, "audit": {"beat": [], "interval": 10}}
    lines = status_text()
    assert "flush: not scheduled by Celery beat; run `manage.py counters_flush` from cron" in lines
    assert any(
        line.startswith(
            "audit: not scheduled by Celery beat; run `manage.py counters_audit` from cron, "
        )
        for line in lines
    ), lines
    assert not any("every 10s" in line for line in lines)

    settings.CELERY_BEAT_SCHEDULE = {"flush": {"task": TASK_NAME, "schedule": 5.0}}
    settings.COUNTERS_AUDIT_INTERVAL = 0
    lines = status_text()
    assert "flush: every 5s by Celery beat" in lines
    assert any(
        line.startswith("audit: periodic audit off (COUNTERS_AUDIT_INTERVAL), ") for line in lines
    )
