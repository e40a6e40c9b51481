"""The continuous audit: slices in keyset order, a cursor per counter that wraps, confirmed
repairs through the delta path, recorded; never beside a rebuild.

Then `manage.py counters_audit` for cron: output, JSON, slices, exit status;
the status shows it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

import counters
from counters.client import get_buffer
from counters.models import AuditCursor, AuditRepair
from counters.ops.status import audit_status
from counters.verify.audit import audit
from counters.verify.hold import audit_holder_key, rebuild_lease
from counters.verify.rebuild import rebuild_all
from notifications.models import Notification, UnreadCounter
from tests.blog import hops, related
from tests.helpers import assert_exact, stored
from tests.procs import project_env, run_manage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


QUICK = 0.05  # seconds between confirming readings: nothing else writes in these tests
#: The counters of tests.blog over related paths, in the order they are declared.
RELATED = [*related.COUNTERS, *hops.COUNTERS]


def add_to_row(user, amount: int) -> None:
    """Raw SQL drift: ``amount`` added to the user's stored counter behind Tally's back."""
    table = connection.ops.quote_name(UnreadCounter._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET count = count + %s WHERE user_id = %s", [amount, user.pk]
        )


def repairs() -> list[tuple]:
    rows = AuditRepair.objects.order_by("pk")
    return list(rows.values_list("counter", "key", "stored", "buffered", "truth"))


@pytest.fixture
def users(make_user):
    """Five users with 0..4 unread notifications, flushed."""
    users = [make_user() for _ in range(5)]
    for i, user in enumerate(users):
        for _ in range(i):
            Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    return users


def run(**kwargs):
    kwargs.setdefault("names", ["unread"])
    kwargs.setdefault("confirm_delay", QUICK)
    return audit(**kwargs)


def test_repairs_confirmed_drift_through_the_delta_path_and_records_it(users, caplog):
    add_to_row(users[1], 40)  # stored 41, truth 1
    add_to_row(users[3], -5)  # stored -2, truth 3 ...
    Notification.objects.create(recipient=users[3], verb="buffered")  # ... + 1 pending, truth 4
    with caplog.at_level(logging.WARNING, logger="counters.verify.audit"):
        result = run()
    [report] = result.counters
    assert (report.checked, report.first, report.last) == (5, users[0].pk, users[4].pk)
    assert {(d.key, d.stored, d.pending, d.truth) for d in report.repaired} == {
        (users[1].pk, 41, 0, 1),
        (users[3].pk, -2, 1, 4),
    }
    assert sorted(repairs()) == sorted(
        [("unread", str(users[1].pk), 41, 0, 1), ("unread", str(users[3].pk), -2, 1, 4)]
    )
    assert [r.delta for r in AuditRepair.objects.order_by("key")] == [-40, 5]
    assert sorted(r.getMessage() for r in caplog.records) == sorted(
        [
            f"audit repaired unread {users[1].pk}: stored 41 + buffered 0, truth 1 (-40)",
            f"audit repaired unread {users[3].pk}: stored -2 + buffered 1, truth 4 (+5)",
        ]
    )
    # The repair is a buffered delta like any other: exact at once, stored after a flush.
    assert stored(users[1]) == 41
    assert_exact(*users)
    assert result.summary().startswith("audited 5 keys of 1 counter, repaired 2 in ")


def test_buffered_and_exact_counters_are_left_alone(users):
    for user in users:
        Notification.objects.create(recipient=user, verb="pending")  # buffered, not flushed
    Notification.objects.filter(recipient=users[4]).first().mark_read()
    result = run()
    assert (result.checked, result.repaired, result.unstable) == (5, 0, 0)
    assert repairs() == []
    assert_exact(*users)


def cursor(name: str = "unread") -> AuditCursor:
    return AuditCursor.objects.get(counter=name)


def test_the_cursor_walks_slices_in_key_order_and_wraps_around(users):
    add_to_row(users[4], 3)
    ranges = []
    for _ in range(4):
        [report] = run(slice_size=2).counters
        ranges.append((report.first, report.last, report.sweep_done, report.sweeps))
    pks = [u.pk for u in users]
    assert ranges == [
        (pks[0], pks[1], False, 0),
        (pks[2], pks[3], False, 0),
        (pks[4], pks[4], True, 1),  # the end: the sweep is complete, the cursor starts over
        (pks[0], pks[1], False, 1),
    ]
    assert repairs() == [("unread", str(pks[4]), 7, 0, 4)]  # the key of the third slice
    row = cursor()
    assert (row.after, row.checked, row.sweeps) == (str(pks[1]), 2, 1)
    assert row.last_sweep_at is not None and row.last_sweep_seconds is not None


def test_a_slice_that_ended_on_the_last_key_completes_the_sweep_on_the_next_run(users):
    checked = []
    for _ in range(3):
        result = run(slice_size=5)
        checked.append((result.checked, result.counters[0].sweep_done))
    # A full page ends on the last key without knowing it is the last one; the next
    # run finds nothing after it, completes the sweep and checks the first slice again.
    assert checked == [(5, False), (5, True), (5, True)]
    assert cursor().sweeps == 2


def test_keys_added_after_the_cursor_are_reached_in_the_same_sweep(users, make_user):
    run(slice_size=3)
    late = make_user()
    Notification.objects.create(recipient=late, verb="v")
    counters.flush()
    add_to_row(late, 2)
    [report] = run(slice_size=3).counters
    assert (report.first, report.last, report.sweep_done) == (users[3].pk, late.pk, False)
    assert repairs() == [("unread", str(late.pk), 3, 0, 1)]


def test_every_counter_with_a_truth_source_has_its_own_cursor(users):
    from tests.blog.models import Comment, Post

    posts = [Post.objects.create(title=str(i)) for i in range(3)]
    for post in posts:
        Comment.objects.create(post=post, approved=True, points=4)
    counters.flush()
    result = audit(slice_size=2, confirm_delay=QUICK)
    checked = {c.counter: (c.checked, c.last) for c in result.counters}
    assert checked == {
        "unread": (2, users[1].pk),
        "post_comments": (2, posts[1].pk),
        "post_points": (2, posts[1].pk),
        # the related keys of tests.blog: no author, post nor owner of theirs here
        **dict.fromkeys(RELATED, (0, None)),
    }
    positions = dict(AuditCursor.objects.values_list("counter", "after"))
    assert positions == {
        "unread": str(users[1].pk),
        "post_comments": str(posts[1].pk),
        "post_points": str(posts[1].pk),
        **dict.fromkeys(RELATED),
    }


def test_a_cursor_whose_key_no_longer_parses_starts_the_sweep_again(users, caplog):
    AuditCursor.objects.create(counter="unread", after="not-an-id")
    with caplog.at_level(logging.WARNING, logger="counters.verify.audit"):
        [report] = run(slice_size=2).counters
    assert report.first == users[0].pk
    assert "cursor 'not-an-id' dropped" in caplog.text


def test_nothing_runs_while_a_rebuild_holds_the_lease(users):
    add_to_row(users[2], 1)
    buffer = get_buffer()
    with rebuild_lease(buffer) as lease:
        assert lease.held
        result = run()
    assert result.counters == [] and result.skipped
    assert result.summary() == f"audit skipped: a rebuild or another audit holds {lease.key}"
    assert repairs() == []
    assert not AuditCursor.objects.exists()
    assert run().repaired == 1


def test_a_full_rebuild_waits_for_a_running_audit_and_the_drift_is_repaired_once(users):
    add_to_row(users[2], 6)
    buffer = get_buffer()
    results = []

    def audit_in_thread() -> None:
        try:
            results.append(run(confirm_delay=0.4))
        finally:
            connection.close()

    auditing = threading.Thread(target=audit_in_thread)
    auditing.start()
    try:
        deadline = time.monotonic() + 10
        while not buffer.client.exists(audit_holder_key(buffer)):  # the audit holds the lease
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reports = rebuild_all(batch_size=2)  # waits, then finds nothing left to repair
    finally:
        auditing.join(30)
    assert results[0].repaired == 1
    assert sum(r.repaired for r in reports) == 0
    assert not buffer.client.exists(audit_holder_key(buffer))
    assert_exact(*users)


def test_status_shows_cursors_and_repairs(users):
    add_to_row(users[1], 2)
    run(slice_size=2)
    status = audit_status()
    assert status["interval"] == 10 and status["slice"] == 1000
    assert status["counters"]["unread"]["position"] == str(users[1].pk)
    assert status["counters"]["unread"]["checked_this_sweep"] == 2
    assert status["counters"]["post_comments"]["sweeps"] == 0  # never run: no cursor yet
    assert status["repairs"]["total"] == status["repairs"]["last_24h"] == 1
    [recent] = status["repairs"]["recent"]
    assert (recent["key"], recent["stored"], recent["buffered"], recent["truth"]) == (
        str(users[1].pk),
        3,
        0,
        1,
    )


def test_old_repair_records_are_pruned_when_a_sweep_completes(users, settings):
    settings.COUNTERS_AUDIT_RETENTION = 3600
    old = AuditRepair.objects.create(counter="unread", key="1", stored=1, buffered=0, truth=0)
    AuditRepair.objects.filter(pk=old.pk).update(repaired_at=timezone.now() - timedelta(hours=2))
    recent = AuditRepair.objects.create(counter="unread", key="2", stored=1, buffered=0, truth=0)
    run(slice_size=2)
    assert AuditRepair.objects.count() == 2  # mid-sweep: nothing pruned
    run(slice_size=10)
    assert list(AuditRepair.objects.values_list("pk", flat=True)) == [recent.pk]


def test_redis_down_is_an_error_not_a_guess(users, settings):
    from counters.base.exceptions import BufferUnavailable

    settings.COUNTERS_REDIS_URL = "redis://127.0.0.1:1/0"
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    with pytest.raises(BufferUnavailable):
        run()
    assert repairs() == []


def test_an_unknown_counter_or_one_without_truth_is_refused(monkeypatch):
    from counters.base import registry
    from counters.base.exceptions import UnknownCounter
    from counters.base.registry import register
    from counters.verify.drift import NoTruthSource

    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    with pytest.raises(UnknownCounter):
        audit(names=["nope"])
    register("audit_no_truth", UnreadCounter, key_field="user")
    with pytest.raises(NoTruthSource):
        audit(names=["audit_no_truth"])


def test_the_beat_task_runs_the_audit_and_logs_its_repairs(users, settings, caplog):
    from counters import tasks

    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # quick confirming readings
    add_to_row(users[2], 5)
    with caplog.at_level(logging.DEBUG, logger="counters"):
        tasks.audit_counters()
    assert repairs() == [("unread", str(users[2].pk), 7, 0, 2)]
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "counters.tasks"]
    assert len(lines) == 1 and lines[0][0] == "INFO", lines
    total = 3 + len(RELATED)  # unread, post_comments, post_points and the related ones
    assert lines[0][1].startswith(f"audited 5 keys of {total} counters, repaired 1 in ")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="counters"):
        tasks.audit_counters()  # nothing to repair: one line at DEBUG
    assert [r.levelname for r in caplog.records if r.name == "counters.tasks"] == ["DEBUG"]
    assert_exact(*users)


def test_the_beat_task_does_nothing_while_the_audit_is_off(users, settings):
    from counters import tasks

    settings.COUNTERS_AUDIT_INTERVAL = 0
    add_to_row(users[2], 5)
    tasks.audit_counters()
    assert repairs() == [] and not AuditCursor.objects.exists()


def test_the_beat_task_logs_one_warning_when_redis_is_down(users, settings, caplog):
    from counters import tasks

    settings.COUNTERS_REDIS_URL = "redis://127.0.0.1:1/0"
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    with caplog.at_level(logging.WARNING, logger="counters"):
        tasks.audit_counters()
    [record] = [r for r in caplog.records if r.name == "counters.tasks"]
    assert record.getMessage().startswith("audit skipped: Redis unreachable at ")


# -- `manage.py counters_audit` for cron -----------------------------------------------


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
def drifted(make_user):
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


def test_prints_one_json_line_per_repair_and_a_summary(drifted):
    code, out, err = run_manage("counters_audit", env=env())
    assert code == 0, err
    lines = out.strip().splitlines()
    assert [json.loads(line) for line in lines[:-1]] == [
        {"counter": "unread", "key": drifted[1].pk, "stored": 40, "buffered": 0, "truth": 2},
        {"counter": "unread", "key": drifted[3].pk, "stored": -1, "buffered": 0, "truth": 4},
    ]
    assert lines[-1].startswith("audited 4 keys of 1 counter, repaired 2 in ")
    assert lines[-1].endswith("; sweep complete: unread")
    assert AuditRepair.objects.count() == 2
    assert_exact(*drifted)
    code, out, _ = run_manage("counters_audit", env=env())
    assert code == 0
    assert out.startswith("audited 4 keys of 1 counter, repaired 0 in ")


def test_json_and_slices_continue_from_the_cursor(drifted):
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
        drifted[0].pk,
        drifted[1].pk,
        False,
    )
    assert unread["repaired"] == [{"key": drifted[1].pk, "stored": 40, "buffered": 0, "truth": 2}]
    code, out, _ = run_manage("counters_audit", "unread", "--json", "--slice", "2", env=env())
    [unread] = json.loads(out)["counters"]
    assert (unread["first"], unread["last"], unread["sweep_done"]) == (
        drifted[2].pk,
        drifted[3].pk,
        False,
    )
    assert AuditCursor.objects.get(counter="unread").after == str(drifted[3].pk)
    assert_exact(*drifted)


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


def test_a_run_beside_a_rebuild_does_nothing_and_succeeds(drifted):
    buffer = get_buffer()
    with rebuild_lease(buffer) as lease:
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


def test_status_shows_the_audit(drifted, settings):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    call_command("counters_audit", "--slice", "2", stdout=StringIO())
    out = StringIO()
    call_command("counters_status", stdout=out)
    lines = out.getvalue().splitlines()
    assert (
        "audit: every 10s by Celery beat, 1000 keys per counter a run; repairs 1 (1 in 24 h, "
        "last " in "\n".join(lines)
    )
    assert any(
        line.startswith(f"  unread: sweep 1 after key {drifted[1].pk} (2 keys so far), ")
        and line.endswith("no sweep done yet")
        for line in lines
    ), lines
    assert any(
        line.startswith(f"  repaired unread {drifted[1].pk} at ")
        and line.endswith(": stored 40 + buffered 0, truth 2 (-38)")
        for line in lines
    ), lines
    out = StringIO()
    call_command("counters_status", "--json", stdout=out)
    audit = json.loads(out.getvalue())["audit"]
    assert audit["counters"]["unread"]["position"] == str(drifted[1].pk)
    assert audit["repairs"]["total"] == 1
