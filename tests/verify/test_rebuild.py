"""Rebuild: finds every wrong counter, repairs through the delta path, safe beside writers.

The notifications' unread counts through rebuild() and the command, then
`manage.py counters_rebuild` on the blog's tracked counters: rows corrupted by
raw SQL are found, and repaired beside writer processes.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import pytest
from django.db import OperationalError, connection

import counters
from counters.verify.rebuild import rebuild
from notifications.models import Notification, UnreadCounter
from tests.blog.models import Comment, Post, PostStats
from tests.blog.truth import assert_exact as assert_blog_exact
from tests.blog.truth import stored as blog_stored
from tests.blog.truth import truth as blog_truth
from tests.helpers import assert_exact, deadlocked, stored, truth
from tests.procs import ROOT, project_env, run_manage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]


@pytest.fixture
def corrupted(make_user):
    """Five users; the stored rows of two of them are wrong on purpose."""
    users = [make_user() for _ in range(5)]
    for i, user in enumerate(users):
        for _ in range(i):
            Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    UnreadCounter.objects.filter(user=users[1]).update(count=40)  # raw SQL drift
    UnreadCounter.objects.filter(user=users[3]).update(count=-2)
    Notification.objects.create(recipient=users[3], verb="buffered")  # pending +1
    return users


def test_rebuild_reports_every_wrong_counter_and_repairs_it(corrupted):
    users = corrupted
    report = rebuild("unread", batch_size=2, confirm_delay=0.05)
    wrong = {(d.key, d.stored, d.pending, d.truth) for d in report.wrong}
    assert wrong == {(users[1].pk, 40, 0, 1), (users[3].pk, -2, 1, 4)}
    assert report.repaired == 2
    assert report.checked == 5
    assert_exact(*users)


def test_dry_run_repairs_nothing(corrupted):
    users = corrupted
    report = rebuild("unread", dry_run=True, confirm_delay=0.05)
    assert len(report.wrong) == 2 and report.repaired == 0
    assert UnreadCounter.objects.get_count(users[1]) == 40


def test_rebuild_of_selected_users_only(corrupted):
    users = corrupted
    report = rebuild("unread", keys=[users[1].pk, users[2].pk], confirm_delay=0.05)
    assert [d.key for d in report.wrong] == [users[1].pk]
    assert report.checked == 2
    assert sum(counters.get_parts("unread", [users[3].pk])[users[3].pk]) == -2 + 1  # untouched
    assert UnreadCounter.objects.get_count(users[3]) == 0  # an unread count never reads < 0


def quick_env(**extra: str) -> dict[str, str]:
    """The project's settings with a short Redis timeout: the command confirms a difference
    after readings twice that timeout apart, so a short one makes confirmations quick."""
    return project_env(COUNTERS_SOCKET_TIMEOUT="0.2", **extra)


def test_command_dry_run_exits_3_with_one_json_line_per_wrong_counter(corrupted):
    users = corrupted
    code, out, err = run_manage("notification_rebuild_counters", "--dry-run", env=quick_env())
    assert code == 3, err
    lines = out.strip().splitlines()
    rows = [json.loads(line) for line in lines[:-1]]
    assert sorted(rows, key=lambda r: r["user"]) == [
        {"user": users[1].pk, "stored": 40, "pending": 0, "truth": 1},
        {"user": users[3].pk, "stored": -2, "pending": 1, "truth": 4},
    ]
    assert lines[-1].startswith("checked 5 unread counters, found 2 wrong")
    assert "checked 5/5 counters (100%)" in err  # plain progress lines when not a TTY


def test_command_repairs_then_finds_nothing(corrupted):
    users = corrupted
    code, out, _ = run_manage("notification_rebuild_counters", "--json", env=quick_env())
    assert code == 0
    data = json.loads(out)
    assert (data["repaired"], data["checked"]) == (2, 5)
    code, out, _ = run_manage(
        "notification_rebuild_counters", "--dry-run", "--user", str(users[1].pk), env=quick_env()
    )
    assert code == 0
    assert out.strip().endswith("found 0 wrong in " + out.strip().split(" in ")[-1])
    assert_exact(*users)


def test_command_refuses_to_guess_when_redis_is_down(corrupted):
    from tests.procs import project_env

    code, _, err = run_manage(
        "notification_rebuild_counters", env=project_env(COUNTERS_REDIS_URL="redis://127.0.0.1:1/0")
    )
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("CommandError: Redis unreachable")


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_rebuild_while_writers_and_flushes_run_repairs_without_new_drift(make_user):
    users = [make_user() for _ in range(8)]
    for user in users:
        for _ in range(3):
            Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    for user in users[::2]:
        UnreadCounter.objects.filter(user=user).update(count=100)
    stop = threading.Event()
    errors = []

    def step(rnd):
        user = rnd.choice(users)
        action = rnd.random()
        if action < 0.4:
            Notification.objects.create(recipient=user, verb="w")
        elif action < 0.7:
            n = Notification.objects.filter(recipient=user).order_by("?").first()
            if n:
                n.mark_read() if rnd.random() < 0.7 else n.mark_unread()
        elif action < 0.8:
            Notification.objects.filter(recipient=user).mark_all_read()
        elif action < 0.9:
            n = Notification.objects.filter(recipient=user).first()
            if n:
                n.delete()
        else:
            counters.flush()

    def writer(seed):
        rnd = random.Random(seed)
        try:
            while not stop.is_set():
                try:
                    step(rnd)
                except OperationalError as exc:
                    if not deadlocked(exc):
                        raise
                    # The database broke a deadlock between the two writers (the victim
                    # counts nothing); the rebuild's work is what this test checks.
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        # Readings 1 s apart: a delta between its writer thread's COMMIT and its push reads
        # as drift. Beside two CPU-bound processes such a thread was seen 0.2 s there; with
        # readings 0.3 s apart a stall of 0.6 s got a delta on its way "repaired" about once
        # in a hundred runs.
        report = rebuild("unread", batch_size=3, confirm_delay=1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == []
    assert report.repaired >= 1
    assert_exact(*users)
    assert [stored(u) for u in users] == [truth(u) for u in users]


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_rebuild_beside_steady_writers_repairs_nothing_that_was_exact(make_user):
    """Writer processes committing all the time make the truth run ahead of Redis
    for a moment after each commit; the rebuild must never take that for drift."""
    users = [make_user() for _ in range(5)]
    ids = ",".join(str(u.pk) for u in users)
    writers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.chaos.writer",
                "--seconds",
                "6",
                "--seed",
                str(seed),
                "--users",
                ids,
                "--hot",
                str(users[0].pk),
            ],
            cwd=ROOT,
            env=project_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    reports = []
    try:
        time.sleep(1.5)  # the writers are up and writing
        while all(w.poll() is None for w in writers) and len(reports) < 30:
            reports.append(rebuild("unread", confirm_delay=0.05))
    finally:
        outputs = [w.communicate(timeout=60) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], outputs
    assert len(reports) >= 5
    assert [r.repaired for r in reports] == [0] * len(reports), [r.wrong for r in reports]
    assert_exact(*users)


# -- `manage.py counters_rebuild` on the blog's tracked counters -----------------------


def env(**extra: str) -> dict[str, str]:
    """The blog app is installed in the test settings; short timeouts make confirmations quick."""
    return quick_env(DJANGO_SETTINGS_MODULE="tests.settings", **extra)


def corrupt(post: Post, **values: int) -> None:
    """Overwrite the post's stored counters with raw SQL."""
    table = connection.ops.quote_name(PostStats._meta.db_table)
    sets = ", ".join(f"{connection.ops.quote_name(c)} = %s" for c in values)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {sets} WHERE post_id = %s", [*values.values(), post.pk])


@pytest.fixture
def posts():
    """Four posts with approved comments, flushed; the rows of two are corrupted."""
    posts = [Post.objects.create(title=str(i)) for i in range(4)]
    for i, post in enumerate(posts):
        for j in range(i + 1):
            Comment.objects.create(post=post, approved=True, points=j + 1)
    counters.flush()
    corrupt(posts[1], comments=40, points=-7)
    corrupt(posts[3], comments=9)
    return posts


def test_dry_run_reports_the_corrupted_rows_and_exits_3(posts):
    code, out, err = run_manage("counters_rebuild", "post_comments", "--dry-run", env=env())
    assert code == 3, err
    lines = out.strip().splitlines()
    assert [json.loads(line) for line in lines[:-1]] == [
        {"counter": "post_comments", "key": posts[1].pk, "stored": 40, "pending": 0, "truth": 2},
        {"counter": "post_comments", "key": posts[3].pk, "stored": 9, "pending": 0, "truth": 4},
    ]
    assert lines[-1].startswith("checked 4 post_comments counters, found 2 wrong")
    assert "checked 4/4 counters (100%)" in err
    assert blog_stored("post_comments", posts[1]) == 40  # nothing repaired


def test_dry_run_of_several_counters_as_json_with_keys(posts):
    keys = ["--key", str(posts[1].pk), "--user", str(posts[2].pk)]
    code, out, _ = run_manage(
        "counters_rebuild", "post_points", "post_comments", "--dry-run", "--json", *keys, env=env()
    )
    assert code == 3
    reports = {r["counter"]: r for r in json.loads(out)["counters"]}
    assert sorted(reports) == ["post_comments", "post_points"]
    assert [(r["checked"], r["repaired"]) for r in reports.values()] == [(2, 0), (2, 0)]
    assert reports["post_points"]["wrong"] == [
        {"key": posts[1].pk, "stored": -7, "pending": 0, "truth": 3}
    ]


def test_clean_counters_exit_0_and_unknown_names_are_refused(posts):
    code, out, _ = run_manage(
        "counters_rebuild", "post_comments", "--dry-run", "--key", str(posts[0].pk), env=env()
    )
    assert code == 0
    assert "found 0 wrong" in out
    code, _, err = run_manage("counters_rebuild", "nope", env=env())
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("CommandError: no counter named 'nope'")


def test_the_full_rebuild_repairs_every_counter(posts, make_user):
    code, out, err = run_manage("counters_rebuild", env=env())
    assert code == 0, err
    checked = [line for line in out.strip().splitlines() if line.startswith("checked ")]
    summaries = checked[:3]  # then the related keys' (none here)
    assert [s.split(" counters,")[0] for s in summaries] == [
        "checked 0 unread",
        "checked 4 post_comments",
        "checked 4 post_points",
    ]
    assert "repaired 2 wrong" in summaries[1] and "repaired 1 wrong" in summaries[2]
    assert_blog_exact(*posts)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_repairs_beside_writer_processes_and_no_new_drift(posts):
    ids = ",".join(str(p.pk) for p in posts)
    command = [sys.executable, "-m", "tests.blog.writer", "--seconds", "6", "--posts", ids]
    writers = [
        subprocess.Popen(
            [*command, "--seed", str(seed)],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    try:
        code, out, err = run_manage(
            "counters_rebuild", "post_comments", "post_points", "--json", env=env(), timeout=120
        )
    finally:
        outputs = [w.communicate(timeout=60) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], outputs
    reports = {r["counter"]: r for r in json.loads(out)["counters"]}
    assert code == 0, err
    assert {k: r["unstable"] for k, r in reports.items()} == {
        "post_comments": [],
        "post_points": [],
    }
    repaired = {k: sorted(d["key"] for d in r["wrong"]) for k, r in reports.items()}
    assert repaired == {
        "post_comments": [posts[1].pk, posts[3].pk],
        "post_points": [posts[1].pk],
    }
    for written, _ in outputs:
        report = json.loads(written)
        assert (report["errors"], sum(report["ops"].values()) > 20) == ({}, True)
    assert_blog_exact(*posts)
    assert [blog_stored("post_points", p) for p in posts] == [
        blog_truth("post_points", p) for p in posts
    ]
