"""Multiprocess mode: processes sharing ``PROMETHEUS_MULTIPROC_DIR`` are added up by the view.

Three real processes (two ``counters_flush`` runs and a writer that finds
Redis unreachable) write to one directory; this test process serves
``/metrics`` from it, as a web worker would.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from counters.base import metrics
from notifications.models import Notification
from tests.helpers import stored, truth
from tests.metrics_scrape import Scrape
from tests.procs import project_env, run_manage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

WRITE = (
    "from django.contrib.auth.models import User; "
    "from notifications.models import Notification; "
    "Notification.objects.create(recipient=User.objects.get(pk={pk}), verb='direct')"
)


def pids(directory: Path, pattern: str = r".*") -> set[int]:
    found = set()
    for path in directory.glob("*.db"):
        match = re.fullmatch(rf"({pattern})_(\d+)\.db", path.name)
        if match:
            found.add(int(match[2]))
    return found


def scrape(client) -> Scrape:
    response = client.get("/metrics")
    assert response.status_code == 200
    return Scrape.parse(response.content.decode())


def test_three_processes_are_added_up(client, settings, monkeypatch, tmp_path, make_user):
    settings.COUNTERS_METRICS = True
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = project_env(PROMETHEUS_MULTIPROC_DIR=str(directory))
    users = [make_user() for _ in range(5)]

    for user in users[:2]:
        Notification.objects.create(recipient=user, verb="first")
    code, out, err = run_manage("counters_flush", env=env)
    assert code == 0, err
    assert ", 2 keys," in out
    for user in users:
        Notification.objects.create(recipient=user, verb="second")
    code, out, err = run_manage("counters_flush", env=env)
    assert code == 0, err
    assert ", 5 keys," in out
    down = {**env, "COUNTERS_REDIS_URL": "redis://127.0.0.1:1/0", "COUNTERS_SOCKET_TIMEOUT": "0.2"}
    code, out, err = run_manage("shell", "-c", WRITE.format(pk=users[0].pk), env=down)
    assert code == 0, err
    writers = pids(directory)
    assert len(writers) == 3 and os.getpid() not in writers

    monkeypatch.setenv(metrics.MULTIPROC_ENV, str(directory))
    result = scrape(client)
    assert result.value("tally_flush_runs_total", outcome="ok") == 2
    assert result.value("tally_flush_duration_seconds_count") == 2
    assert result.value("tally_flushed_keys_total") == 7
    assert result.value("tally_flushed_deltas_total") == 7
    assert result.value("tally_fallback_writes_total") == 1
    assert result.value("tally_fallback_keys_total") == 1
    assert result.value("tally_flush_in_progress") == 0
    # Read at scrape time, not from the files: the same in every mode.
    assert result.total("tally_backlog_keys") == 0
    assert result.value("tally_redis_up") == 1
    assert [stored(u) for u in users] == [truth(u) for u in users] == [3, 2, 1, 1, 1]

    # The flush processes are gone: their live gauge goes, what they counted stays.
    flushers = pids(directory, "gauge_livesum")
    assert len(flushers) == 2
    for pid in flushers:
        metrics.mark_process_dead(pid)
    assert pids(directory, "gauge_livesum") == set()
    again = scrape(client)
    assert again.value("tally_flush_runs_total", outcome="ok") == 2
    assert again.value("tally_flushed_keys_total") == 7
    assert ("tally_flush_in_progress", frozenset({("database", "default")})) not in again.samples
