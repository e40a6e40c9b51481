"""The audit repairs real drift beside live writers and flushers, and nothing else.

Rows corrupted with raw SQL while writer processes keep changing the same
counters are repaired, each exactly once, and no other key is ever
"repaired". A writer SIGKILLed right after its COMMIT loses its delta; the
audit gives it back within one sweep of that key. A commit still queued in
another process's sender is never repaired: the audit's confirming readings
are at least the sender's delay apart, and ``check`` refuses a confirmation
window shorter than that delay.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from django.db import connection

import counters
from counters.checks import check_settings
from counters.models import AuditRepair
from counters.verify.audit import AuditResult, audit
from notifications.models import Notification, UnreadCounter
from tests.blog.models import Comment, Post, PostStats
from tests.blog.truth import assert_exact as assert_blog_exact
from tests.helpers import assert_exact, in_redis, stored, truth
from tests.procs import ROOT, project_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]


WRITE_SECONDS = 10.0
CORRUPTION = 7


def repairs() -> list[tuple[str, str, int]]:
    """(counter, key, what the repair added) of every recorded repair."""
    return sorted((r.counter, r.key, r.delta) for r in AuditRepair.objects.all())


def add_raw(model, column: str, key_column: str, keys: list[int], amount: int) -> None:
    """``column = column + amount`` with raw SQL: exact whatever a flush does meanwhile."""
    qn = connection.ops.quote_name
    table = qn(model._meta.db_table)
    marks = ", ".join(["%s"] * len(keys))
    sql = f"UPDATE {table} SET {qn(column)} = {qn(column)} + %s WHERE {qn(key_column)} IN ({marks})"
    with connection.cursor() as cursor:
        cursor.execute(sql, [amount, *keys])
        assert cursor.rowcount == len(keys)


@pytest.fixture
def flusher() -> Iterator[None]:
    """A thread that flushes all the time, like the beat task would."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                counters.flush()
                time.sleep(0.1)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(60)
    assert errors == []


def start_writers(module: str, env: dict[str, str], *args: str) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--seconds",
                str(WRITE_SECONDS),
                "--seed",
                str(seed),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]


def audit_while(
    writers: list[subprocess.Popen], done: Callable[[], bool], **kwargs
) -> list[AuditResult]:
    """Audit runs one after the other while the writers run, until ``done()``."""
    results = []
    while all(w.poll() is None for w in writers) and not done():
        results.append(audit(confirm_delay=0.3, **kwargs))
    return results


def finish(writers: list[subprocess.Popen]) -> None:
    outputs = [w.communicate(timeout=60) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], outputs
    for out, _ in outputs:
        report = json.loads(out)
        assert sum(report["ops"].values()) > 20, report


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_raw_sql_corruption_of_unread_counts_is_repaired_while_writers_write(make_user, flusher):
    users = [make_user() for _ in range(10)]
    for user in users:
        for _ in range(3):
            Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    ids = ",".join(str(u.pk) for u in users)
    writers = start_writers(
        "tests.chaos.writer", project_env(), "--users", ids, "--hot", str(users[0].pk)
    )
    corrupted = [users[0], users[4], users[7]]  # the hot user among them
    expected = [("unread", str(u.pk), -CORRUPTION) for u in corrupted]
    try:
        time.sleep(1.0)  # the writers are up and writing
        add_raw(UnreadCounter, "count", "user_id", [u.pk for u in corrupted], CORRUPTION)
        results = audit_while(writers, lambda: len(repairs()) >= 3, names=["unread"], slice_size=4)
        repaired_while_writing = repairs()
        # and more runs while they write: an exact key is never "repaired"
        results += audit_while(writers, lambda: False, names=["unread"], slice_size=4)
    finally:
        finish(writers)
    assert repaired_while_writing == sorted(expected), [r.summary() for r in results]
    assert repairs() == sorted(expected)
    assert sum(r.checked for r in results) >= 2 * len(users)  # two sweeps at least
    assert_exact(*users)
    assert [truth(u) for u in users] == [UnreadCounter.objects.get_count(u) for u in users]


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_raw_sql_corruption_of_tracked_counters_is_repaired_while_writers_write(flusher):
    posts = [Post.objects.create(title=str(i)) for i in range(6)]
    for post in posts:
        for points in (1, 2, 3):
            Comment.objects.create(post=post, approved=True, points=points)
    counters.flush()
    env = project_env(DJANGO_SETTINGS_MODULE="tests.settings")
    writers = start_writers("tests.blog.writer", env, "--posts", ",".join(str(p.pk) for p in posts))
    expected = sorted(
        [
            ("post_comments", str(posts[1].pk), -CORRUPTION),
            ("post_comments", str(posts[4].pk), -CORRUPTION),
            ("post_points", str(posts[4].pk), 100),
        ]
    )
    try:
        time.sleep(1.0)
        add_raw(PostStats, "comments", "post_id", [posts[1].pk, posts[4].pk], CORRUPTION)
        add_raw(PostStats, "points", "post_id", [posts[4].pk], -100)
        results = audit_while(writers, lambda: len(repairs()) >= 3, slice_size=4)
        repaired_while_writing = repairs()
        results += audit_while(writers, lambda: False, slice_size=4)
    finally:
        finish(writers)
    assert repaired_while_writing == expected, [r.summary() for r in results]
    assert repairs() == expected
    assert_blog_exact(*posts)


@pytest.mark.parametrize("at", ["on_commit", "push"])
def test_a_writer_killed_right_after_commit_is_repaired_within_one_sweep_of_its_key(at, make_user):
    users = [make_user() for _ in range(5)]
    for i, user in enumerate(users):
        for _ in range(i):
            Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    victim = users[3]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.killed_writer", "--user", str(victim.pk), "--at", at],
        cwd=ROOT,
        env=project_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert truth(victim) == 4  # the change committed
    lost = truth(victim) - UnreadCounter.objects.get_count(victim)
    if at == "push":
        assert lost == 1  # the process died before its delta reached Redis
    # (At "on_commit" the deltas have already been pushed today: they are sent
    # right after the COMMIT, before Django runs on_commit callbacks.)
    results: list[AuditResult] = []
    while not (results and results[-1].counters[0].sweep_done):  # one sweep
        results.append(audit(names=["unread"], slice_size=2, confirm_delay=0.05))
    assert len(results) == 3
    assert repairs() == ([("unread", str(victim.pk), 1)] if lost else [])
    assert_exact(*users)


# -- a commit still queued in another process's sender ---------------------------------


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
