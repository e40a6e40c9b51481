"""`manage.py counters_rebuild`: finds rows corrupted by raw SQL, repairs them beside writers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from django.db import connection

import counters
from tests.blog.models import Comment, Post, PostStats
from tests.blog.truth import assert_exact, stored, truth
from tests.procs import ROOT, project_env, run_manage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]


def env(**extra: str) -> dict[str, str]:
    """The blog app is installed in the test settings; short timeouts make confirmations quick."""
    return project_env(
        DJANGO_SETTINGS_MODULE="tests.settings", COUNTERS_SOCKET_TIMEOUT="0.2", **extra
    )


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
    assert stored("post_comments", posts[1]) == 40  # nothing repaired


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
    summaries = out.strip().splitlines()[-3:]
    assert [s.split(" counters,")[0] for s in summaries] == [
        "checked 0 unread",
        "checked 4 post_comments",
        "checked 4 post_points",
    ]
    assert "repaired 2 wrong" in summaries[1] and "repaired 1 wrong" in summaries[2]
    assert_exact(*posts)


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
    assert_exact(*posts)
    assert [stored("post_points", p) for p in posts] == [truth("post_points", p) for p in posts]
