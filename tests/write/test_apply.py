"""Applying deltas: rows created and updated in one statement, one lock order, dead keys dropped.

The races run on PostgreSQL with real connections: one applier is paused
right after its first statement on the counter table, while another one
commits or queues on its locks.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

import counters
from counters.models import FlushBatch
from counters.write import apply
from counters.write.upserts import on_conflict
from notifications.models import Notification, UnreadCounter
from tests.conftest import has_row_locks, is_postgres
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
    # The flush's own batch; the whole ledger is shown if it differs.
    ledger = FlushBatch.objects.values_list("kind", "keys", "deltas", "dropped")
    flushed = ledger.filter(kind=FlushBatch.Kind.FLUSH, dropped=1)
    assert list(flushed.values_list("keys", "deltas")) == [(2, 5)], list(ledger)
    assert not UnreadCounter.objects.filter(user_id=gone_pk).exists()
    assert_exact(alice, bob)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
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
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
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
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
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
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
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


# -- the PostgreSQL batch UPDATE: by CASE over a few deltas, by a join over many -------------


def planner_settings() -> tuple[str, str]:
    """``enable_seqscan`` and ``enable_bitmapscan`` as this connection's planner sees them."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('enable_seqscan'), current_setting('enable_bitmapscan')"
        )
        return cursor.fetchone()


@pytest.mark.parametrize(
    "distinct",
    [1, 3, on_conflict.CASE_DELTAS // 2, on_conflict.CASE_DELTAS // 2 + 1, on_conflict.CASE_DELTAS],
)
def test_a_batch_adds_each_key_its_own_delta_whatever_their_number(distinct, settings, make_user):
    """Deltas ``-distinct .. -1`` on users whose rows exist, ``1 .. distinct`` on new users:
    ``2 * distinct`` distinct deltas in one batch.

    Up to :data:`~counters.write.upserts.on_conflict.CASE_DELTAS` distinct deltas the
    UPDATE adds them by ``CASE``; beyond, by a join (on PostgreSQL). Either way
    the users without a row go through the upsert, and every row ends exact.
    """
    settings.COUNTERS_SHARDS = 1  # one batch
    old = [make_user() for _ in range(distinct)]
    Notification.objects.bulk_create(
        [Notification(recipient=user, verb="v") for user in old for _ in range(distinct)]
    )
    counters.flush()
    new = [make_user() for _ in range(distinct)]
    for i, user in enumerate(old, 1):  # user i reads i of its notifications: delta -i
        ids = Notification.objects.filter(recipient=user).values_list("pk", flat=True)[:i]
        Notification.objects.filter(pk__in=list(ids)).update(is_read=True)
    Notification.objects.bulk_create(  # new user i gets i notifications: delta +i
        [Notification(recipient=user, verb="v") for i, user in enumerate(new, 1) for _ in range(i)]
    )
    with CaptureQueriesContext(connection) as queries:
        result = counters.flush()
    assert (result.batches, result.keys, result.dropped) == (1, 2 * distinct, 0)
    if connection.vendor == "postgresql":
        update = next(q["sql"] for q in queries if f'UPDATE "{COUNTER_TABLE}"' in q["sql"])
        by_case = distinct * 2 <= on_conflict.CASE_DELTAS
        assert ("AS d(k, n)" in update) is not by_case, update  # the join of the deltas
    assert (
        [stored(u) for u in old]
        == [truth(u) for u in old]
        == [distinct - i for i in range(1, distinct + 1)]
    )
    assert [stored(u) for u in new] == [truth(u) for u in new] == list(range(1, distinct + 1))


@pytest.mark.skipif(not is_postgres(), reason="PostgreSQL's planner")
def test_the_batch_update_scans_the_keys_index_in_key_order_on_a_small_table(make_user):
    """On a table of a few rows the planner scans it whole, in the table's physical order (the
    reverse of the keys' here): under ``IN_KEY_ORDER`` the UPDATE's rows come from the key's
    index, in key order."""
    users = [make_user() for _ in range(3)]
    for user in reversed(users):  # physical order: the reverse of the keys'
        UnreadCounter.objects.create(user=user, count=5)
    with connection.cursor() as cursor:
        cursor.execute(f'ANALYZE "{COUNTER_TABLE}"')
    spec = counters.get_spec("unread")
    names = on_conflict.Names(spec, connection)
    keys = sorted(u.pk for u in users)
    ctes, params = on_conflict._by_case(names, {1: keys[:1], -1: keys[1:]}, keys, [])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN WITH {ctes} SELECT count(*) FROM u", params)
        alone = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute(on_conflict.IN_KEY_ORDER)
        cursor.execute(f"EXPLAIN WITH {ctes} SELECT count(*) FROM u", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    assert "Seq Scan on" in alone, alone  # what the planner picks by itself
    assert f"Index Scan using {COUNTER_TABLE}_pkey on {COUNTER_TABLE}" in plan, plan
    assert "Seq Scan on" not in plan and "Bitmap" not in plan, plan


@pytest.mark.skipif(not is_postgres(), reason="PostgreSQL's planner")
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_flush_batch_and_a_direct_write_update_in_key_order(settings, redis_down_in, make_user):
    """The flush sets the planner settings with its limits, in the statement it runs anyway; a
    direct write, which has no limits, runs ``IN_KEY_ORDER`` itself. Both end with their
    transaction."""
    settings.COUNTERS_SHARDS = 1
    users = [make_user() for _ in range(3)]
    Notification.objects.bulk_create([Notification(recipient=u, verb="v") for u in users])
    counters.flush()  # the rows exist: the next batch is all UPDATE
    Notification.objects.bulk_create(
        [Notification(recipient=u, verb="v") for i, u in enumerate(users) for _ in range(i + 1)]
    )
    seen = []

    def planner() -> None:
        seen.append(planner_settings())

    update = f'UPDATE "{COUNTER_TABLE}"'
    with CaptureQueriesContext(connection) as queries, after_first(update, planner):
        assert counters.flush().keys == 3
    assert seen == [("off", "off")]
    assert on_conflict.IN_KEY_ORDER not in [q["sql"] for q in queries]
    planner()
    assert seen[-1] == ("on", "on")

    redis_down_in.add(threading.current_thread())
    with CaptureQueriesContext(connection) as queries, after_first(update, planner):
        Notification.objects.bulk_create([Notification(recipient=u, verb="v") for u in users])
    assert seen[-1] == ("off", "off")
    assert [q["sql"] for q in queries].count(on_conflict.IN_KEY_ORDER) == 1
    planner()
    assert seen[-1] == ("on", "on")
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK, keys=3).count() == 1
    assert_exact(*users)


@pytest.mark.skipif(not is_postgres(), reason="PostgreSQL's planner")
def test_a_flush_or_an_apply_inside_a_transaction_leaves_its_planner_as_it_was(settings, make_user):
    """Set inside a transaction of the caller's, the planner settings would last until it
    ends: the flush then leaves them to the statement, which puts them back."""
    settings.COUNTERS_SHARDS = 1
    users = [make_user() for _ in range(2)]
    Notification.objects.bulk_create([Notification(recipient=u, verb="v") for u in users])
    with transaction.atomic():
        assert counters.flush().keys == 2  # creates the rows
        assert planner_settings() == ("on", "on")
    Notification.objects.bulk_create([Notification(recipient=u, verb="v") for u in users])
    with transaction.atomic():
        assert counters.flush().keys == 2  # adds to them by CASE
        assert planner_settings() == ("on", "on")
    with transaction.atomic():
        applied = apply.apply_deltas({f"unread:{u.pk}": 1 for u in users}, "default")
        assert (applied.keys, planner_settings()) == (2, ("on", "on"))
        transaction.set_rollback(True)  # the deltas added by hand
    assert [stored(u) for u in users] == [truth(u) for u in users] == [2, 2]


@pytest.mark.skipif(not is_postgres(), reason="PostgreSQL's parameters")
def test_a_connection_binding_on_the_server_joins_the_deltas(settings, monkeypatch, make_user):
    """Its arrays would not be constants the ``CASE`` could hash: the batch takes the join."""
    settings.COUNTERS_SHARDS = 1
    users = [make_user() for _ in range(2)]
    Notification.objects.bulk_create([Notification(recipient=u, verb="v") for u in users])
    counters.flush()
    options = {**connection.settings_dict.get("OPTIONS", {}), "server_side_binding": True}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    Notification.objects.bulk_create([Notification(recipient=u, verb="v") for u in users])
    with CaptureQueriesContext(connection) as queries:
        assert counters.flush().keys == 2
    update = next(q["sql"] for q in queries if f'UPDATE "{COUNTER_TABLE}"' in q["sql"])
    assert "AS d(k, n)" in update and "CASE WHEN t." not in update, update
    assert [stored(u) for u in users] == [truth(u) for u in users] == [2, 2]
