"""Applying deltas: rows created and updated in one statement, one lock order, dead keys dropped.

The races run on PostgreSQL with real connections: one applier is paused
right after its first statement on the counter table, while another one
commits or queues on its locks.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection

import counters
from counters.models import FlushBatch
from counters.write import apply
from notifications.models import Notification, UnreadCounter
from tests.conftest import has_row_locks
from tests.helpers import Worker, after_first, assert_exact, stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

needs_row_locks = pytest.mark.skipif(
    not has_row_locks(), reason="needs row locks between connections"
)

COUNTER_TABLE = UnreadCounter._meta.db_table


@pytest.fixture(autouse=True)
def one_lane(settings):
    """A race pauses a statement of its :class:`Worker`'s own connection: the flush it runs
    keeps to that thread (one lane)."""
    settings.COUNTERS_FLUSH_LANES = 1


@pytest.fixture(params=["native", "generic"], ids=["native", "generic"])
def applier(request, monkeypatch) -> str:
    """The database's own upsert, or the generic path other vendors use."""
    if request.param == "generic":
        monkeypatch.setattr(apply, "APPLIERS", {}, raising=False)
    return request.param


# -- every database -------------------------------------------------------------------


def test_flush_creates_rows_adds_to_rows_and_drops_deleted_users(applier, settings, make_user):
    settings.COUNTERS_SHARDS = 1  # one batch
    alice, bob, gone = make_user(), make_user(), make_user()
    Notification.objects.create(recipient=alice, verb="v")
    counters.flush()
    assert stored(alice) == 1
    Notification.objects.bulk_create(
        [Notification(recipient=alice, verb="v") for _ in range(2)]
        + [Notification(recipient=bob, verb="v") for _ in range(3)]
        + [Notification(recipient=gone, verb="v")]
    )
    counters.add("unread", gone.pk, 1)  # by hand: the cascade below does not take it back
    gone_pk = gone.pk
    gone.delete()  # counts -1 for its notification; the +1 added by hand is still buffered
    result = counters.flush()
    assert (result.keys, result.deltas, result.dropped) == (2, 5, 1)
    assert FlushBatch.objects.filter(dropped=1).values_list("keys", "deltas").get() == (2, 5)
    assert not UnreadCounter.objects.filter(user_id=gone_pk).exists()
    assert_exact(alice, bob)


def test_a_direct_write_for_a_deleted_user_drops_only_that_user(applier, redis_down_in, make_user):
    redis_down_in.add(threading.current_thread())
    alice, gone = make_user(), make_user()
    gone_pk = gone.pk
    gone.delete()
    counters.add_many("unread", {gone_pk: 4})
    Notification.objects.bulk_create([Notification(recipient=alice, verb="v") for _ in range(2)])
    rows = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK)
    assert sorted(rows.values_list("keys", "deltas", "dropped")) == [(0, 0, 1), (1, 2, 0)]
    assert not UnreadCounter.objects.filter(user_id=gone_pk).exists()
    assert stored(alice) == truth(alice) == 2


# -- races (PostgreSQL, MySQL/MariaDB) ---------------------------------------------------


@needs_row_locks
def test_a_row_created_between_two_statements_of_a_flush_misses_no_delta(
    applier, redis_down_in, make_user
):
    """A direct write creates and commits the row while the flush is between statements."""
    carol = make_user()
    Notification.objects.create(recipient=carol, verb="buffered")
    assert not UnreadCounter.objects.filter(user=carol).exists()
    flush = Worker(counters.flush, pause_on=COUNTER_TABLE)
    flush.start()
    flush.wait_paused()

    def write() -> None:
        redis_down_in.add(threading.current_thread())
        Notification.objects.create(recipient=carol, verb="direct")

    writer = Worker(write)
    writer.start()
    writer.wait_blocked_or_done()
    flush.resume()
    result = flush.finish()
    writer.finish()
    assert (result.keys, result.dropped, result.failed_shards) == (1, 0, {})
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK, keys=1).count() == 1
    assert_exact(carol)


@needs_row_locks
def test_a_direct_write_and_a_flush_lock_rows_in_one_order(
    applier, redis_down_in, settings, make_user
):
    """Deltas ordered differently by value used to lock alice and bob in opposite orders."""
    settings.COUNTERS_SHARDS = 1  # both users in one flush batch
    alice, bob = make_user(), make_user()
    assert alice.pk < bob.pk
    for user in (alice, bob):
        Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    Notification.objects.bulk_create(  # buffered: alice +1, bob +2
        [Notification(recipient=alice, verb="v")]
        + [Notification(recipient=bob, verb="v") for _ in range(2)]
    )

    def write() -> None:  # written directly: alice +2, bob +1
        redis_down_in.add(threading.current_thread())
        Notification.objects.bulk_create(
            [Notification(recipient=alice, verb="v") for _ in range(2)]
            + [Notification(recipient=bob, verb="v")]
        )

    writer = Worker(write, pause_on=COUNTER_TABLE)
    writer.start()
    writer.wait_paused()
    flush = Worker(counters.flush)
    flush.start()
    flush.wait_blocked_or_done()
    writer.resume()
    writer.finish()
    result = flush.finish()  # a deadlock fails the flush (FlushFailed)
    assert (result.batches, result.keys, result.failed_shards) == (1, 2, {})
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK, keys=2).count() == 1
    assert_exact(alice, bob)


@needs_row_locks
def test_a_direct_write_drops_only_the_user_deleted_while_it_runs(
    applier, redis_down_in, make_user
):
    """The user is deleted after the write created its row: the deferred FK check would fail."""
    redis_down_in.add(threading.current_thread())
    bob, carol = make_user(), make_user()
    Notification.objects.create(recipient=bob, verb="v")  # bob's row exists
    assert stored(bob) == 1
    assert not UnreadCounter.objects.filter(user=carol).exists()
    carol_pk = carol.pk
    deleter = Worker(carol.delete)

    def delete_carol() -> None:
        deleter.start()
        deleter.finish()

    if connection.vendor == "mysql":
        # InnoDB checks a foreign key at the INSERT, not at COMMIT: a deletion after it
        # waits for the write (and then fails, as a Django deletion racing the creation of
        # any child row does on MySQL). So carol goes between the UPDATE of the rows that
        # exist and the reading of the parents of those that do not.
        if applier == "generic":
            pytest.skip("the generic applier's INSERT IGNORE holds carol's row: see above")
        statement = "JSON_TABLE"
    else:
        statement = f'INSERT INTO "{COUNTER_TABLE}"'
    with after_first(statement, delete_carol):
        Notification.objects.bulk_create(
            [Notification(recipient=bob, verb="v") for _ in range(5)]
            + [Notification(recipient=carol, verb="v") for _ in range(2)]
        )
    assert not deleter.is_alive() and deleter.error is None
    assert not type(carol).objects.filter(pk=carol_pk).exists()
    assert not UnreadCounter.objects.filter(user_id=carol_pk).exists()
    row = FlushBatch.objects.get(kind=FlushBatch.Kind.FALLBACK, dropped__gt=0)
    assert (row.keys, row.deltas, row.dropped, row.unsettled) == (1, 5, 1, None)
    assert stored(bob) == truth(bob) == 6
    assert_exact(bob)
