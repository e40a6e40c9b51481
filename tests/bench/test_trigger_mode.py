"""The bench's ``trigger`` mode: what it counts is checked, and the trigger never outlives a run.

The quick run of the whole bench (``test_bench_command.py``) checks the
mode's figures; here the trigger itself, a run that fails in the middle of a
``trigger`` run, and the probes of the cost per insert. No timing is asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.db import connection

from benchmarks import trigger
from benchmarks.probes import BackendCpu, Cost, CostSample, RedisSample, process_cpu_s
from counters import paused
from notifications.models import Notification, UnreadCounter
from tests.procs import ROOT, project_env

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the trigger mode is PostgreSQL only"
)


def bench_triggers() -> list[str]:
    """Bench triggers on the notification table, and bench trigger functions (by name)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tgname FROM pg_trigger WHERE tgname LIKE %s "
            "UNION ALL SELECT proname FROM pg_proc WHERE proname LIKE %s",
            [trigger.NAME_PATTERN, trigger.NAME_PATTERN],
        )
        return [name for (name,) in cursor.fetchall()]


@postgres_only
@pytest.mark.django_db
def test_the_trigger_counts_unread_inserts_and_is_dropped_after_the_block(make_user):
    users = [make_user().pk for _ in range(3)]
    UnreadCounter.objects.bulk_create([UnreadCounter(user_id=users[0], count=5)])
    counted = trigger.CounterTrigger("bench-0123456789ab", users)
    with counted.counting():
        assert counted.installed()
        with paused():  # as the writers insert: only the trigger counts
            for user, is_read in [(0, False), (0, False), (1, False), (1, True), (2, True)]:
                Notification.objects.create(recipient_id=users[user], verb="x", is_read=is_read)
    assert not counted.installed() and bench_triggers() == []
    assert (counted.rows, counted.users_off) == (3, 0)
    rows = dict(UnreadCounter.objects.filter(user_id__in=users).values_list("user_id", "count"))
    assert rows == {users[0]: 7, users[1]: 1}  # an existing row grew, a missing one was made


@postgres_only
@pytest.mark.django_db
def test_the_check_finds_a_row_the_trigger_did_not_keep(make_user):
    users = [make_user().pk for _ in range(2)]
    counted = trigger.CounterTrigger("bench-0123456789ab", users)
    with counted.counting():
        with paused():
            Notification.objects.create(recipient_id=users[0], verb="x")
        UnreadCounter.objects.create(user_id=users[1], count=1)  # a count nothing inserted
    assert (counted.rows, counted.users_off) == (1, 1)


@postgres_only
@pytest.mark.django_db
def test_a_failing_block_drops_the_trigger():
    counted = trigger.CounterTrigger("bench-0123456789ab", [])
    with pytest.raises(RuntimeError, match="mid-run"), counted.counting():
        assert counted.installed()
        raise RuntimeError("mid-run")
    assert bench_triggers() == []


@postgres_only
@pytest.mark.django_db
def test_a_trigger_left_by_a_killed_bench_is_dropped_by_the_next():
    left = trigger.CounterTrigger("bench-0123456789ab", [])
    left._create()
    assert bench_triggers() == ["bench_0123456789ab_unread"] * 2  # trigger and function
    assert trigger.drop_leftovers() == ["bench_0123456789ab_unread"]
    assert bench_triggers() == []


@postgres_only
@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
def test_a_writer_killed_during_a_trigger_run_fails_the_bench_and_drops_the_trigger():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench.failing_bench"],
        cwd=ROOT,
        env={**project_env(), "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines()[0] == "bench triggers when the trigger run starts: 1"
    assert proc.stderr.strip().splitlines()[-1] == ("CommandError: writer 0 exited (status -9)"), (
        proc.stderr
    )
    assert bench_triggers() == []
    assert not Notification.objects.exists() and not UnreadCounter.objects.exists()


@pytest.mark.skipif(connection.vendor == "postgresql", reason="the mode runs on PostgreSQL")
def test_the_mode_is_skipped_with_a_note_on_other_databases():
    note = trigger.unsupported()
    assert note == (
        "trigger mode skipped: it is a PostgreSQL trigger, and the database is "
        f"{connection.display_name}"
    )


def test_process_cpu_is_read_from_proc():
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    assert process_cpu_s(os.getpid()) is not None
    assert process_cpu_s(2**22 + 1) is None  # above the largest pid


@pytest.mark.parametrize(
    ("pids", "host", "reason"),
    [
        pytest.param([None, None], "", "the database is not PostgreSQL", id="sqlite"),
        pytest.param(
            [os.getpid()],
            "db.example",
            "the server is at db.example, not on this machine",
            id="far",
        ),
        pytest.param(
            [os.getpid()],
            "127.0.0.1",
            f"backend {os.getpid()} is not a postgres process on this machine",
            id="not-postgres",
        ),
    ],
)
def test_backend_cpu_says_why_it_cannot_be_read(pids, host, reason):
    backend = BackendCpu(pids, host)
    assert backend.reason == reason
    assert backend.sample() is None


def test_a_cost_unknown_once_stays_unknown():
    cost = Cost()
    redis = RedisSample(0.5, 0, 0), RedisSample(0.5005, 0, 0)
    cost.add(10, 0.001, CostSample(1.0, 100, redis[0]), CostSample(1.002, 1100, redis[1]))
    assert cost.figures("off") == {
        "off_writer_cpu_us": 100.0,
        "off_backend_cpu_us": 200.0,
        "off_wal_bytes": 100.0,
        "off_redis_cpu_us": 50.0,
    }
    cost.add(10, 0.001, CostSample(None, 0), CostSample(None, 0))
    assert cost.figures("off")["off_backend_cpu_us"] is None
    assert cost.figures("off")["off_redis_cpu_us"] is None
