"""Deferred acknowledgements across processes: a writer that ends with replies unread, or with
pushes not yet written (COUNTERS_WRITE_BATCH)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import counters
from counters.models import FlushBatch
from tests.helpers import assert_exact, in_redis, truth
from tests.procs import ROOT, project_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.serial]


def run_writer(user, end: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``tests.acks_writer`` committing 5 notifications for ``user``, then ending by ``end``."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "tests.acks_writer", "--user", str(user.pk)),
            *("--notifications", "5", "--end", end),
        ],
        cwd=ROOT,
        env=project_env(COUNTERS_DEFER_ACKS="1", **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("end", ["exit", "os-exit", "sigkill"])
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_writer_that_ends_with_replies_unread_counts_each_change_once(end, make_user):
    alice = make_user()
    proc = run_writer(alice, end)
    assert proc.returncode == (-9 if end == "sigkill" else 0), proc.stderr
    assert proc.stdout.splitlines()[0] == "unread 5"  # every reply unread when it ended
    assert in_redis(alice) == truth(alice) == 5
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count() == 0
    assert_exact(alice)


@pytest.mark.parametrize("end", ["os-exit", "sigkill"])
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_batched_writer_killed_before_its_write_loses_those_commits_until_the_audit(
    end, make_user
):
    from counters.verify.audit import audit
    from notifications.models import Notification, UnreadCounter

    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")
    counters.flush()
    proc = run_writer(alice, end, COUNTERS_WRITE_BATCH="16")
    assert proc.returncode == (-9 if end == "sigkill" else 0), proc.stderr
    assert proc.stdout.splitlines()[0] == "unread 5"
    assert in_redis(alice) == 0  # taken by the line, never written
    assert (truth(alice), UnreadCounter.objects.get_count(alice)) == (6, 1)
    result = audit(names=["unread"], confirm_delay=0.05)
    assert result.repaired == 1
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count() == 0
    assert_exact(alice)
