"""The audit never repairs a commit still queued in another process's sender: its
confirming readings are at least the sender's delay apart, and ``check`` refuses a
confirmation window shorter than that delay."""

from __future__ import annotations

import subprocess
import sys

import pytest

import counters
from counters.audit import audit
from counters.checks import check_settings
from counters.models import AuditRepair
from tests.helpers import in_redis, stored, truth
from tests.procs import ROOT, project_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]

#: A delay longer than the check allows, so that the old confirmation window (0.8 s with
#: a 0.1 s socket timeout) is far shorter than the wait and no noise can hide it.
DELAY_MS = 4000
COMMITS = 6


@pytest.fixture
def sender_settings(settings):
    settings.COUNTERS_SEND_DELAY_MS = DELAY_MS
    settings.COUNTERS_SOCKET_TIMEOUT = 0.1


def test_a_commit_queued_in_another_process_is_not_repaired(sender_settings, make_user):
    alice = make_user()
    counters.flush()
    writer = subprocess.Popen(
        [
            *(sys.executable, "-m", "tests.sender_writer", "--user", str(alice.pk)),
            *("--notifications", str(COMMITS), "--end", "linger", "--linger", "20"),
        ],
        cwd=ROOT,
        env=project_env(COUNTERS_SEND_DELAY_MS=str(DELAY_MS), COUNTERS_SEND_BATCH="10000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline().strip()
        assert line == f"queued {COMMITS}", writer.stderr.read() if writer.stderr else ""
        assert (truth(alice), in_redis(alice), stored(alice)) == (COMMITS, 0, 0)
        result = audit(names=["unread"])  # the readings must outlast the writer's queue
        assert result.repaired == 0, result.as_dict()
        assert AuditRepair.objects.count() == 0
        assert in_redis(alice) == COMMITS  # the writer's own push arrived meanwhile
    finally:
        writer.kill()
        writer.communicate(timeout=30)
    counters.flush()
    assert (stored(alice), truth(alice)) == (COMMITS, COMMITS)


def test_check_refuses_a_confirmation_window_shorter_than_the_sender_delay(settings):
    settings.COUNTERS_SEND_DELAY_MS = 1000
    settings.COUNTERS_SOCKET_TIMEOUT = 0.1
    errors = check_settings()
    assert [e.id for e in errors] == ["counters.E070"]
    assert "COUNTERS_SEND_DELAY_MS" in errors[0].msg
    assert "shorter than" in errors[0].msg


@pytest.mark.parametrize(
    ("delay_ms", "timeout"), [(1000, 2.0), (1000, 0.3), (0, 0.1), (5, 0.1)], ids=str
)
def test_check_accepts_a_window_that_outlasts_the_sender(settings, delay_ms, timeout):
    settings.COUNTERS_SEND_DELAY_MS = delay_ms
    settings.COUNTERS_SOCKET_TIMEOUT = timeout
    assert check_settings() == []
