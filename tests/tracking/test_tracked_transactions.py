"""Tracked counters and transactions: savepoints, rollbacks, paused(), loaddata, other databases."""

from __future__ import annotations

import pytest
from django.core import serializers
from django.core.management import call_command
from django.db import IntegrityError, transaction

import counters
from counters.models import FlushBatch
from tests.blog.models import Comment, Post, PostStats
from tests.blog.truth import assert_exact, stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


class Rollback(Exception):
    pass


@pytest.fixture
def post():
    return Post.objects.create(title="p")


def value(post, name: str = "post_comments") -> int:
    return counters.get_value(name, post.pk)


def test_a_rolled_back_transaction_counts_nothing(post):
    with pytest.raises(Rollback), transaction.atomic():
        Comment.objects.create(post=post, approved=True, points=3)
        assert (value(post), value(post, "post_points")) == (1, 3)  # its own change
        raise Rollback
    assert (value(post), value(post, "post_points")) == (0, 0)
    assert_exact(post)


def test_savepoints_keep_what_survived(post):
    kept = Comment.objects.create(post=post, approved=False, points=2)
    with transaction.atomic():
        Comment.objects.create(post=post, approved=True, points=1)
        try:
            with transaction.atomic():
                Comment.objects.filter(pk=kept.pk).update(approved=True)
                Comment.objects.create(post=post, approved=True, points=100)
                raise Rollback
        except Rollback:
            pass
        with transaction.atomic():
            kept.points = 5
            kept.approved = True
            kept.save()
        sid = transaction.savepoint()
        Comment.objects.all().delete()
        transaction.savepoint_rollback(sid)
    assert (value(post), value(post, "post_points")) == (2, 6)
    assert_exact(post)


def test_get_or_create_losing_a_unique_race_counts_nothing(post):
    Comment.objects.create(post=post, approved=True, points=1)
    existing = Comment.objects.get()
    with pytest.raises(IntegrityError), transaction.atomic():
        Comment.objects.create(pk=existing.pk, post=post, approved=True, points=9)
    assert (value(post), value(post, "post_points")) == (1, 1)
    assert_exact(post)


def test_manual_transactions_count_only_what_commits(post):
    transaction.set_autocommit(False)
    try:
        Comment.objects.create(post=post, approved=True, points=2)
        transaction.rollback()
        Comment.objects.create(post=post, approved=True, points=3)
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert (value(post), value(post, "post_points")) == (1, 3)
    assert_exact(post)


def test_paused_counts_nothing_and_a_rebuild_repairs_it(post):
    Comment.objects.create(post=post, approved=True, points=1)
    with counters.paused():
        c = Comment.objects.create(post=post, approved=True, points=10)
        Comment.objects.filter(pk=c.pk).update(points=20)
        Comment.objects.bulk_create([Comment(post=post, approved=True, points=5)])
        Comment.objects.filter(points=1).delete()
    assert (value(post), value(post, "post_points")) == (1, 1)  # nothing of the block
    assert (truth("post_comments", post), truth("post_points", post)) == (2, 25)
    from counters.verify.rebuild import rebuild

    for name in ("post_comments", "post_points"):
        assert rebuild(name, confirm_delay=0.01).repaired == 1
    assert_exact(post)


def test_paused_is_per_thread(post):
    import threading

    def create():
        try:
            Comment.objects.create(post=post, approved=True, points=4)
        finally:
            from django.db import connection

            connection.close()

    with counters.paused():
        thread = threading.Thread(target=create)
        thread.start()
        thread.join(30)
    assert (value(post), value(post, "post_points")) == (1, 4)
    assert_exact(post)


def test_loaddata_saves_raw_rows_uncounted(post, tmp_path):
    Comment.objects.create(post=post, approved=True, points=3)
    fixture = tmp_path / "comments.json"
    extra = [Comment(pk=10_000 + i, post=post, approved=True, points=2) for i in range(3)]
    fixture.write_text(serializers.serialize("json", extra))
    call_command("loaddata", str(fixture), verbosity=0)
    assert Comment.objects.count() == 4
    assert (value(post), value(post, "post_points")) == (1, 3)
    from counters.verify.rebuild import rebuild

    rebuild("post_comments", confirm_delay=0.01)
    rebuild("post_points", confirm_delay=0.01)
    assert_exact(post)


def test_model_save_base_inside_a_transaction_is_counted_by_the_signals(post):
    c = Comment.objects.create(post=post, approved=False, points=3)
    stale = Comment.objects.get(pk=c.pk)
    with transaction.atomic():
        stale.approved = True
        stale.save_base()  # no wrapper: pre_save still locks inside this transaction
    assert (value(post), value(post, "post_points")) == (1, 3)
    assert_exact(post)


def test_counter_rows_are_created_with_the_other_columns_defaulted(post):
    Comment.objects.create(post=post, approved=True, points=4)
    counters.flush()
    assert list(PostStats.objects.values_list("post", "comments", "points")) == [(post.pk, 1, 4)]
    Comment.objects.create(post=post, approved=True, points=-4)
    counters.flush()
    assert (stored("post_comments", post), stored("post_points", post)) == (2, 0)


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_each_database_counts_its_own_rows(settings):
    settings.COUNTERS_DATABASES = ["default", "other"]
    here = Post.objects.create(title="default")
    there = Post.objects.using("other").create(pk=here.pk, title="other")
    Comment.objects.create(post=here, approved=True, points=1)
    for points in (5, 6):
        Comment.objects.using("other").create(post=there, approved=True, points=points)
    Comment.objects.using("other").filter(points=5).update(points=50)
    Comment.objects.using("other").filter(points=6).delete()
    assert counters.get_value("post_points", here.pk) == 1
    assert counters.get_value("post_points", there.pk, using="other") == 50
    assert_exact(here)
    assert_exact(there, using="other")
    assert FlushBatch.objects.using("other").exists()


def test_a_cascade_locks_the_rows_of_the_parent_at_once(post):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def queries_to_delete(n: int) -> int:
        parent = Post.objects.create(title=f"{n} comments")
        Comment.objects.bulk_create([Comment(post=parent, approved=True) for _ in range(n)])
        with CaptureQueriesContext(connection) as run:
            parent.delete()
        return len(run.captured_queries)

    assert queries_to_delete(2) == queries_to_delete(30)
    Comment.objects.create(post=post, approved=True, points=2)
    assert_exact(post)


def test_a_row_moved_away_before_a_cascade_is_counted_where_it_went(post, monkeypatch):
    """Django deletes the rows it collected by primary key, even one that moved meanwhile."""
    from django.db.models import deletion

    other = Post.objects.create(title="other")
    moved = Comment.objects.create(post=post, approved=True, points=5)
    Comment.objects.create(post=post, approved=True, points=1)
    real_delete = deletion.Collector.delete

    def move_then_delete(collector):
        # another request moves the comment after Django collected it
        Comment.objects.filter(pk=moved.pk).update(post=other)
        monkeypatch.setattr(deletion.Collector, "delete", real_delete)
        return real_delete(collector)

    monkeypatch.setattr(deletion.Collector, "delete", move_then_delete)
    post.delete()
    assert not Comment.objects.filter(pk=moved.pk).exists()
    assert (value(other), value(other, "post_points")) == (0, 0)
    assert_exact(other)
