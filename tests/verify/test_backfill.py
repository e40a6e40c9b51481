"""New counters over existing rows: the truth is read until the first full rebuild completes.

Comments exist before the counter is declared (it counts them into
``blog.DeclTally.votes``, a column no other counter holds): reads return the
SQL truth, ``counters_status`` shows the counter backfilling, writes meanwhile
stay exact, the flush runs the rebuild, then the stored rows are the truth
and reads go back to row + buffered deltas.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
from collections.abc import Iterator

import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.db import connection, connections
from django.db.models import Count, Q

import counters
from counters.base import registry
from counters.models import CounterState
from counters.read import backfill
from counters.read import values as reads
from counters.tracking import trackers
from counters.verify.rebuild import rebuild
from tests.blog.models import Comment, DeclTally, Post

# No writer runs beside these rebuilds: they confirm a difference without the default wait.
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("quick_confirm"),
]

NAME = "backfilled_comments"


def declare() -> None:
    counters.track(NAME, Comment, key="post", into="blog.DeclTally.votes", where=Q(approved=True))


@pytest.fixture(autouse=True)
def scratch_registry(transactional_db, monkeypatch) -> Iterator[None]:
    """Declarations made by a test are undone after it; the counter was never seen."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_tracked_fields", "_attnames", "_names"):
        monkeypatch.setattr(trackers, name, dict(getattr(trackers, name)))
    backfill.forget()
    backfill.seen_after_migrate(using="default")  # the apps' counters, as after migrate
    CounterState.objects.filter(name=NAME).delete()
    yield
    backfill.forget()


def truth(post: Post | int) -> int:
    pk = getattr(post, "pk", post)
    return Comment.objects.filter(post_id=pk, approved=True).count()


def all_truth() -> dict[int, int]:
    rows = Comment.objects.filter(approved=True).values("post").annotate(n=Count("pk"))
    found = {row["post"]: row["n"] for row in rows}
    return {pk: found.get(pk, 0) for pk in Post.objects.values_list("pk", flat=True)}


def stored(post: Post | int) -> int:
    pk = getattr(post, "pk", post)
    return DeclTally.objects.filter(pk=pk).values_list("votes", flat=True).first() or 0


def state() -> str:
    return backfill.status()["counters"][NAME]["state"]


def status_json() -> dict:
    out = io.StringIO()
    call_command("counters_status", "--json", stdout=out)
    return json.loads(out.getvalue())


def status_text() -> str:
    out = io.StringIO()
    call_command("counters_status", stdout=out)
    return out.getvalue()


@pytest.fixture
def old_rows() -> list[Post]:
    """Three posts with comments written before the counter exists, and one without."""
    posts = [Post.objects.create(title=f"p{i}") for i in range(4)]
    for i, post in enumerate(posts[:3]):
        for j in range(3 + 2 * i):
            Comment.objects.create(post=post, approved=j % 3 != 0)
    counters.flush()  # the blog's own counters are flushed: only the new one is behind
    return posts


def test_a_new_counter_over_existing_rows_reads_its_truth_until_its_rebuild(old_rows):
    declare()
    values = counters.get_values(NAME, [p.pk for p in old_rows])
    assert values == {p.pk: truth(p) for p in old_rows}
    assert any(values.values())
    assert state() == backfill.BACKFILLING
    # Row + buffered alone is partial: it does not count the old comments.
    parts = reads.get_parts(NAME, [old_rows[2].pk])
    assert sum(parts[old_rows[2].pk]) == 0 != truth(old_rows[2])
    assert CounterState.objects.get(name=NAME).backfilled_at is None

    status = status_json()
    assert status["backfill"]["backfilling"] == [NAME]
    assert status["backfill"]["counters"][NAME]["state"] == "backfilling"
    assert f"BACKFILLING {NAME}" in status_text()


def test_writes_while_backfilling_stay_exact_and_the_flush_ends_it(old_rows):
    declare()
    first, second, third, empty = old_rows
    Comment.objects.create(post=first, approved=True)
    Comment.objects.filter(post=second, approved=True).first().delete()
    Comment.objects.filter(post=third, approved=False).update(approved=True)
    Comment.objects.create(post=empty, approved=True)
    for post in old_rows:
        assert counters.get_value(NAME, post.pk) == truth(post)
    assert state() == backfill.BACKFILLING

    result = counters.flush()  # flushes the deltas, then rebuilds the new counter
    assert not result.failed_shards
    assert state() == backfill.EXACT
    assert CounterState.objects.get(name=NAME).backfilled_at is not None
    assert backfill.backfilling() == []
    assert status_json()["backfill"]["backfilling"] == []
    assert "BACKFILLING" not in status_text()
    for post in old_rows:
        assert counters.get_value(NAME, post.pk) == truth(post)
        assert sum(reads.get_parts(NAME, [post.pk])[post.pk]) == truth(post)

    counters.flush()  # the repairs, buffered, reach the rows
    assert {p.pk: stored(p) for p in old_rows} == all_truth()
    Comment.objects.create(post=empty, approved=True)
    assert counters.get_value(NAME, empty.pk) == truth(empty)
    counters.flush()
    assert stored(empty) == truth(empty)


def test_async_reads_return_the_truth_while_backfilling(old_rows):
    declare()

    async def read() -> dict:
        try:
            one = await counters.aget_value(NAME, old_rows[1].pk)
            every = await counters.aget_values(NAME, [p.pk for p in old_rows])
        finally:  # the thread the reads hop to closes its connections
            await sync_to_async(connections.close_all)()
        return {"one": one, "all": every}

    got = asyncio.run(read())
    assert got == {"one": truth(old_rows[1]), "all": {p.pk: truth(p) for p in old_rows}}


def test_a_read_in_a_transaction_sees_its_own_rows(old_rows):
    from django.db import transaction

    declare()
    with transaction.atomic():
        Comment.objects.create(post=old_rows[0], approved=True)
        assert counters.get_value(NAME, old_rows[0].pk) == truth(old_rows[0])
    assert counters.get_value(NAME, old_rows[0].pk) == truth(old_rows[0])


def test_a_counter_over_an_empty_table_is_exact_from_the_start():
    post = Post.objects.create(title="empty")
    declare()
    assert counters.get_value(NAME, post.pk) == 0
    assert state() == backfill.EXACT
    Comment.objects.create(post=post, approved=True)
    assert counters.get_value(NAME, post.pk) == 1
    assert sum(reads.get_parts(NAME, [post.pk])[post.pk]) == 1


def test_into_rows_that_hold_values_are_taken_as_counted(old_rows):
    """A counter counting before its state was kept (an upgrade) is not backfilled again."""
    DeclTally.objects.create(post=old_rows[0], votes=truth(old_rows[0]))
    declare()
    assert state() == backfill.EXACT


def test_the_first_seen_state_stands_and_is_seen_after_migrate(old_rows):
    declare()
    assert backfill.see([registry.get_spec(NAME)]) == {NAME}
    Comment.objects.all().delete()  # the table is empty now, but the counter was seen
    backfill.seen_after_migrate(using="default")
    assert state() == backfill.BACKFILLING
    CounterState.objects.filter(name=NAME).delete()
    backfill.seen_after_migrate(using="default")
    assert CounterState.objects.get(name=NAME).backfilled_at is not None


def test_without_auto_rebuild_a_rebuild_ends_it(old_rows, settings):
    settings.COUNTERS_AUTO_REBUILD = False
    declare()
    counters.flush()
    assert state() == backfill.BACKFILLING
    rebuild(NAME, keys=[old_rows[0].pk])  # some keys only: not a full rebuild
    assert state() == backfill.BACKFILLING
    report = rebuild(NAME, dry_run=True)
    assert report.wrong and state() == backfill.BACKFILLING
    out = io.StringIO()
    call_command("counters_rebuild", NAME, stdout=out, stderr=io.StringIO())
    assert state() == backfill.EXACT
    for post in old_rows:
        assert counters.get_value(NAME, post.pk) == truth(post)


def test_random_writes_and_flushes_while_backfilling_end_exact(old_rows, settings):
    """Flushes that do not rebuild (auto rebuild off) keep it backfilling; then one does."""
    settings.COUNTERS_AUTO_REBUILD = False
    declare()
    rng = random.Random(25)
    posts = old_rows + [Post.objects.create(title=f"more{i}") for i in range(3)]
    for step in range(120):
        roll = rng.random()
        post = rng.choice(posts)
        if roll < 0.45:
            Comment.objects.create(post=post, approved=rng.random() < 0.7)
        elif roll < 0.6:
            victim = Comment.objects.filter(post=post).order_by("?").first()
            if victim is not None:
                victim.delete()
        elif roll < 0.75:
            victim = Comment.objects.filter(post=post).order_by("?").first()
            if victim is not None:
                victim.approved = not victim.approved
                victim.save()
        elif roll < 0.85:
            moved = Comment.objects.filter(post=post).first()
            if moved is not None:
                moved.post = rng.choice(posts)
                moved.save()
        else:
            counters.flush()
        if step % 10 == 0:
            assert counters.get_values(NAME, [p.pk for p in posts]) == all_truth()
    assert state() == backfill.BACKFILLING
    assert counters.get_values(NAME, [p.pk for p in posts]) == all_truth()

    settings.COUNTERS_AUTO_REBUILD = True
    counters.flush()
    assert state() == backfill.EXACT
    assert counters.get_values(NAME, [p.pk for p in posts]) == all_truth()
    counters.flush()
    assert {p.pk: stored(p) for p in posts} == all_truth()


def test_raw_sql_rows_before_the_declaration_are_backfilled():
    post = Post.objects.create(title="raw")
    table = connection.ops.quote_name(Comment._meta.db_table)
    with counters.paused():
        Comment.objects.create(post=post, approved=True)
    with connection.cursor() as cursor:
        cols = [f.column for f in Comment._meta.concrete_fields if not f.primary_key]
        row = (
            Comment.objects.filter(post=post)
            .values_list(*[f.attname for f in Comment._meta.concrete_fields if not f.primary_key])
            .get()
        )
        quoted = ", ".join(connection.ops.quote_name(c) for c in cols)
        holes = ", ".join(["%s"] * len(cols))
        for _ in range(4):
            cursor.execute(f"INSERT INTO {table} ({quoted}) VALUES ({holes})", list(row))
    declare()
    assert counters.get_value(NAME, post.pk) == 5 == truth(post)
    assert state() == backfill.BACKFILLING
    counters.flush()
    assert state() == backfill.EXACT
    counters.flush()
    assert stored(post) == 5


def test_a_database_without_any_state_takes_its_counters_as_exact(old_rows):
    """No state at all (a test database emptied by a flush): nothing to backfill from."""
    CounterState.objects.all().delete()
    backfill.forget()
    declare()
    assert state() == backfill.EXACT
    # migrate (and flush) see every counter by its rows, whatever the table holds.
    CounterState.objects.all().delete()
    backfill.forget()
    backfill.seen_after_migrate(using="default")
    assert state() == backfill.BACKFILLING


def test_a_parallel_flush_ends_it_too(old_rows, settings):
    from config.celery import app
    from counters import tasks

    declare()
    settings.COUNTERS_FLUSH_PARALLELISM = 4
    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    try:
        Comment.objects.create(post=old_rows[3], approved=True)
        assert counters.get_value(NAME, old_rows[3].pk) == 1
        assert state() == backfill.BACKFILLING
        tasks.flush_counters()
    finally:
        app.conf.task_always_eager = before
    assert state() == backfill.EXACT
    assert counters.get_values(NAME, [p.pk for p in old_rows]) == all_truth()
    counters.flush()
    assert {p.pk: stored(p) for p in old_rows} == all_truth()
