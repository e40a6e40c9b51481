"""`manage.py counters_audit` for cron: output, JSON, slices, exit status; the status shows it."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection

import counters
from counters import api
from counters.models import AuditCursor, AuditRepair
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact
from tests.procs import project_env, run_manage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

REDIS_DOWN = "redis://127.0.0.1:1/0"
DB_DOWN = "postgres://postgres@127.0.0.1:1/nowhere"


def env(**extra: str) -> dict[str, str]:
    """Short Redis timeouts make the confirming readings quick."""
    return project_env(COUNTERS_SOCKET_TIMEOUT="0.2", **extra)


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def users(make_user):
    """Four users with 1..4 unread notifications, flushed; two stored rows are wrong."""
    users = [make_user() for _ in range(4)]
    for i, user in enumerate(users):
        for _ in range(i + 1):
            Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    table = connection.ops.quote_name(UnreadCounter._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET count = 40 WHERE user_id = %s", [users[1].pk])
        cursor.execute(f"UPDATE {table} SET count = -1 WHERE user_id = %s", [users[3].pk])
    return users


def test_prints_one_json_line_per_repair_and_a_summary(users):
    code, out, err = run_manage("counters_audit", env=env())
    assert code == 0, err
    lines = out.strip().splitlines()
    assert [json.loads(line) for line in lines[:-1]] == [
        {"counter": "unread", "key": users[1].pk, "stored": 40, "buffered": 0, "truth": 2},
        {"counter": "unread", "key": users[3].pk, "stored": -1, "buffered": 0, "truth": 4},
    ]
    assert lines[-1].startswith("audited 4 keys of 1 counter, repaired 2 in ")
    assert lines[-1].endswith("; sweep complete: unread")
    assert AuditRepair.objects.count() == 2
    assert_exact(*users)
    code, out, _ = run_manage("counters_audit", env=env())
    assert code == 0
    assert out.startswith("audited 4 keys of 1 counter, repaired 0 in ")


def test_json_and_slices_continue_from_the_cursor(users):
    code, out, err = run_manage("counters_audit", "--json", "--slice", "2", env=env())
    assert code == 0, err
    data = json.loads(out)
    assert (data["using"], data["checked"], data["repaired"], data["skipped"]) == (
        "default",
        2,
        1,
        None,
    )
    [unread] = data["counters"]
    assert (unread["first"], unread["last"], unread["sweep_done"]) == (
        users[0].pk,
        users[1].pk,
        False,
    )
    assert unread["repaired"] == [{"key": users[1].pk, "stored": 40, "buffered": 0, "truth": 2}]
    code, out, _ = run_manage("counters_audit", "unread", "--json", "--slice", "2", env=env())
    [unread] = json.loads(out)["counters"]
    assert (unread["first"], unread["last"], unread["sweep_done"]) == (
        users[2].pk,
        users[3].pk,
        False,
    )
    assert AuditCursor.objects.get(counter="unread").after == str(users[3].pk)
    assert_exact(*users)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(["nope"], "CommandError: no counter named 'nope' is registered", id="name"),
        pytest.param(["--slice", "0"], "CommandError: --slice must be at least 1", id="slice"),
        pytest.param(
            ["--database", "nope"],
            "CommandError: --database: no database alias 'nope' in DATABASES",
            id="database",
        ),
    ],
)
def test_bad_arguments_fail_with_one_line(args, expected):
    code, _, err = run_manage("counters_audit", *args, env=env())
    assert code == 1
    assert one_line(err) == expected


def test_redis_down_fails_with_one_line_and_json():
    code, out, err = run_manage("counters_audit", "--json", env=env(COUNTERS_REDIS_URL=REDIS_DOWN))
    assert code == 1
    data = json.loads(out)
    assert data["redis"] == "unreachable"
    assert data["error"].startswith(f"Redis unreachable at {REDIS_DOWN}")
    assert one_line(err) == f"CommandError: {data['error']}"


def test_database_down_fails_with_one_line():
    code, _, err = run_manage("counters_audit", env=env(DATABASE_URL=DB_DOWN))
    assert code == 1
    assert one_line(err).startswith("CommandError: database error: ")


def test_a_run_beside_a_rebuild_does_nothing_and_succeeds(users):
    buffer = api.get_buffer()
    with api.rebuild_lease(buffer) as lease:
        code, out, err = run_manage("counters_audit", env=env())
        assert (code, err) == (0, "")
        assert out.strip() == f"audit skipped: a rebuild or another audit holds {lease.key}"
        # a rebuild of some counters repairs too: it needs the lease as well
        code, _, err = run_manage("counters_rebuild", "unread", env=env())
        assert code == 1
        assert one_line(err) == (
            f"CommandError: another rebuild or audit is running (it holds {lease.key}); "
            "try again later"
        )
        code, _, _ = run_manage("counters_rebuild", "unread", "--dry-run", env=env())
        assert code == 3  # a dry run repairs nothing and needs no lease
    assert not AuditRepair.objects.exists()


def test_status_shows_the_audit(users, settings):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    call_command("counters_audit", "--slice", "2", stdout=StringIO())
    out = StringIO()
    call_command("counters_status", stdout=out)
    lines = out.getvalue().splitlines()
    assert "audit: every 10s, 1000 keys per counter a run; repairs 1 (1 in 24 h, last " in (
        "\n".join(lines)
    )
    assert any(
        line.startswith(f"  unread: sweep 1 after key {users[1].pk} (2 keys so far), ")
        and line.endswith("no sweep done yet")
        for line in lines
    ), lines
    assert any(
        line.startswith(f"  repaired unread {users[1].pk} at ")
        and line.endswith(": stored 40 + buffered 0, truth 2 (-38)")
        for line in lines
    ), lines
    out = StringIO()
    call_command("counters_status", "--json", stdout=out)
    audit = json.loads(out.getvalue())["audit"]
    assert audit["counters"]["unread"]["position"] == str(users[1].pk)
    assert audit["repairs"]["total"] == 1
