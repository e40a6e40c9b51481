"""The apply transaction runs under lock, statement and idle limits derived from the lease
and the time budget; the session's own settings are put back after the flush.

So a flusher frozen inside its apply transaction (SIGSTOP, like a paused VM)
never makes a later flush wait past its time budget; the status names it;
counts stay exact.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest
from django.core.management import call_command
from django.db import connection

import counters
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.flushing.waits import MIN_IDLE, MIN_WAIT, Limits, apply_limits
from counters.models import FlushBatch
from counters.ops.status import gather
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth
from tests.procs import ROOT, manage, project_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.mark.parametrize(
    ("lease", "remaining", "expected"),
    [
        (30, 100, Limits(lock=100, statement=100, idle=60)),
        (30, 5, Limits(lock=5, statement=30, idle=60)),
        (30, 0.01, Limits(lock=MIN_WAIT, statement=30, idle=MIN_IDLE)),
        (0.4, 5, Limits(lock=5, statement=5, idle=MIN_IDLE)),
        (0.4, 0.01, Limits(lock=MIN_WAIT, statement=MIN_WAIT, idle=MIN_IDLE)),
        (120, 10, Limits(lock=10, statement=120, idle=240)),
    ],
    ids=str,
)
def test_limits_come_from_the_lease_and_the_budget(lease, remaining, expected):
    assert apply_limits(lease, remaining) == expected


UNITS_MS = {"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000}


def as_ms(setting: str) -> int:
    """A PostgreSQL duration setting as shown ("19987ms", "20s", "1min") in milliseconds."""
    number = setting.rstrip("abcdefghijklmnopqrstuvwxyz")
    return int(number) * UNITS_MS[setting[len(number) :]]


def session_settings() -> tuple:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), "
                "current_setting('idle_in_transaction_session_timeout')"
            )
            return cursor.fetchone()
        if connection.vendor == "mysql":
            cursor.execute(f"SELECT {', '.join(f'@@SESSION.{v}' for v in mysql_variables())}")
            return cursor.fetchone()
        cursor.execute("PRAGMA busy_timeout")
        return cursor.fetchone()


def mysql_variables() -> list[str]:
    """The lock wait, statement and idle limits of a MySQL or MariaDB session."""
    if connection.mysql_is_mariadb:
        return ["innodb_lock_wait_timeout", "max_statement_time", "idle_transaction_timeout"]
    return ["innodb_lock_wait_timeout", "max_execution_time", "wait_timeout"]


def test_the_apply_transaction_runs_under_the_limits(settings, make_user):
    settings.COUNTERS_LEASE_TIMEOUT = 8
    users = [make_user() for _ in range(6)]
    Notification.objects.notify(users, verb="v")
    before = session_settings()
    seen: list[tuple] = []
    real = flusher.apply_deltas

    def spy(deltas, using):
        seen.append(session_settings())
        return real(deltas, using)

    with mock.patch.object(flusher, "apply_deltas", spy):
        counters.flush(time_budget=20)
    assert seen
    if connection.vendor == "postgresql":
        # Locks: the budget left (just under 20 s); statements: that, or the 8 s lease if
        # longer; idle: twice the lease, at least 60 s.
        for lock, statement, idle in seen:
            assert 19_000 < as_ms(lock) <= 20_000
            assert as_ms(statement) == as_ms(lock)
            assert as_ms(idle) == 60_000
    elif connection.vendor == "mysql":
        # The lock wait in whole seconds; MariaDB's statement limit in seconds, MySQL's in
        # milliseconds; the idle limit in seconds.
        scale = 1 if connection.mysql_is_mariadb else 1000
        for lock, statement, idle in seen:
            assert lock == 20, seen
            assert 19 * scale < float(statement) <= 20 * scale, seen
            assert idle == 60, seen
    else:
        assert all(19_000 < busy <= 20_000 for (busy,) in seen), seen
    assert session_settings() == before  # put back after the flush
    assert [stored(u) for u in users] == [truth(u) for u in users] == [1] * 6


# -- a flusher frozen inside its apply transaction (serial: it stops a process) --------


BUDGET = 5
FROZEN_APP = "tally-frozen-flusher"
SECOND_APP = "tally-second-flusher"


def env(application_name: str, **extra: str) -> dict[str, str]:
    return project_env(application_name=application_name, COUNTERS_SHARDS="1", **extra)


def wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)  # MySQL's lock waits refresh when unread for 0.1 s


@pytest.fixture
def users(settings, make_user, per_commit) -> list:
    settings.COUNTERS_SHARDS = 1
    people = [make_user() for _ in range(12)]
    Notification.objects.notify(people, verb="v")
    Notification.objects.notify(people[:5], verb="w")
    return people


def blocked_by(pid: int) -> list[dict]:
    return [b for b in gather(get_buffer())["blocked_flushes"] if b["blocked_by"]["pid"] == pid]


@pytest.mark.serial
@pytest.mark.parametrize("end", ["resume", "kill"])
def test_a_frozen_flusher_blocks_no_flush_past_its_budget(users, end):
    buffer = get_buffer()
    frozen = subprocess.Popen(
        [sys.executable, "-m", "tests.frozen_flusher"],
        cwd=ROOT,
        env=env(FROZEN_APP, COUNTERS_LEASE_TIMEOUT="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    second = None
    try:
        assert frozen.stdout is not None
        line = frozen.stdout.readline().split()
        assert line[:1] == ["frozen"], frozen.stderr.read() if frozen.stderr else ""
        frozen_pid = int(line[1])
        # Its lease runs out while it is frozen: the next flusher takes the shard and
        # finds the batch in flight, its ledger row not committed.
        wait_for(lambda: not buffer.client.exists(buffer.key(0, "lease")), 30, "lease expiry")
        started = time.monotonic()
        second = manage("counters_flush", "--time-budget", str(BUDGET), env=env(SECOND_APP))
        if connection.vendor in ("postgresql", "mysql"):
            [wait] = wait_for(lambda: blocked_by(frozen_pid), 30, "the blocked flush")
            # Application names are PostgreSQL's: MySQL sessions have none.
            second_app, frozen_app = (
                (SECOND_APP, FROZEN_APP) if connection.vendor == "postgresql" else ("-", "-")
            )
            assert wait["application"] == (None if second_app == "-" else second_app)
            assert wait["blocked_by"]["state"] == "idle in transaction"
            out = io.StringIO()
            call_command("counters_status", stdout=out)
            assert f"BLOCKED FLUSH: pid {wait['pid']} ({second_app})" in out.getvalue()
            assert f"held by pid {frozen_pid} ({frozen_app}, idle in transaction" in (
                out.getvalue()
            )
            payload = io.StringIO()
            call_command("counters_status", "--json", stdout=payload)
            assert '"blocked_flushes"' in payload.getvalue()
        out, err = second.communicate(timeout=BUDGET + 60)
        elapsed = time.monotonic() - started
        assert elapsed < BUDGET + 10, (elapsed, out, err)
        assert second.returncode == 1, (out, err)
        message = err.strip().splitlines()[-1]  # after the log lines, the one-line failure
        if connection.vendor == "postgresql":
            assert message == (
                "CommandError: flush failed in 1 shard(s); shard 0: "
                "canceling statement due to lock timeout"
            ), err
        elif connection.vendor == "mysql":
            assert message == (
                "CommandError: flush failed in 1 shard(s); shard 0: "
                "(1205, 'Lock wait timeout exceeded; try restarting transaction')"
            ), err
        else:  # SQLite locks the whole database: the ledger's pruning fails too
            assert message == "CommandError: database error: database is locked", err
        assert buffer.inflight_ids(), "the frozen batch stays in flight"
        assert FlushBatch.objects.count() == 0
        # Still exact while frozen: the batch in flight is counted once.
        assert [UnreadCounter.objects.get_count(u) for u in users] == [truth(u) for u in users]
    finally:
        if end == "resume":
            frozen.send_signal(signal.SIGCONT)
        else:
            frozen.kill()
            frozen.send_signal(signal.SIGCONT) if frozen.poll() is None else None
        frozen.communicate(timeout=60)
        if second is not None and second.poll() is None:
            second.kill()
            second.communicate()
    if end == "resume":
        assert frozen.returncode == 0
        assert FlushBatch.objects.count() == 1  # it committed its batch
    else:
        assert frozen.returncode == -signal.SIGKILL
        assert FlushBatch.objects.count() == 0  # its transaction was rolled back
    counters.flush()
    assert buffer.inflight_ids() == {}
    assert [(u.pk, stored(u)) for u in users] == [(u.pk, truth(u)) for u in users]
    assert sum(truth(u) for u in users) == 17
    assert sum(FlushBatch.objects.values_list("deltas", flat=True)) == 17
