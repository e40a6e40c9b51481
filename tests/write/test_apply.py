"""Applying deltas: rows created and updated in one statement, one lock order, dead keys dropped.

The races run on PostgreSQL with real connections: one applier is paused
right after its first statement on the counter table, while another one
commits or queues on its locks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection

import counters
from counters.base.exceptions import NotConnected
from counters.buffer.store import Buffer
from counters.models import FlushBatch
from counters.write import apply
from notifications.models import Notification, UnreadCounter
from tests.conftest import has_row_locks
from tests.helpers import assert_exact, backend_pid, lock_poll, stored, truth, waits_on_lock

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

needs_row_locks = pytest.mark.skipif(
    not has_row_locks(), reason="needs row locks between connections"
)

#: Seconds any step of a race may take before the test gives up.
WAIT = 20
COUNTER_TABLE = UnreadCounter._meta.db_table


@pytest.fixture(params=["native", "generic"], ids=["native", "generic"])
def applier(request, monkeypatch) -> str:
    """The database's own upsert, or the generic path other vendors use."""
    if request.param == "generic":
        monkeypatch.setattr(apply, "APPLIERS", {}, raising=False)
    return request.param


@pytest.fixture
def redis_down_in(monkeypatch) -> set[threading.Thread]:
    """Threads whose pushes fail as if Redis were unreachable (so they write to the DB)."""
    threads: set[threading.Thread] = set()
    real_push = Buffer.push

    def push(self: Buffer, deltas: Any, push_id: str) -> set[int]:
        if threading.current_thread() in threads:
            raise NotConnected("Error connecting to Redis (injected)")
        return real_push(self, deltas, push_id)

    monkeypatch.setattr(Buffer, "push", push)
    return threads


class Worker(threading.Thread):
    """Runs ``target`` on a DB connection of its own; keeps its result or error.

    With ``pause_on``, it stops right after its first statement whose SQL
    contains that text, until :meth:`resume`.
    """

    def __init__(self, target: Callable[[], Any], *, pause_on: str | None = None) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.pause_on = pause_on
        self.started_sql = threading.Event()
        self.paused = threading.Event()
        self.resumed = threading.Event()
        self.pid: int | None = None
        self.result: Any = None
        self.error: BaseException | None = None

    def _pause(self, execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if self.pause_on in sql and not self.paused.is_set():
            self.paused.set()
            self.resumed.wait(WAIT)
        return result

    def run(self) -> None:
        try:
            self.pid = backend_pid()
            self.started_sql.set()
            hook = connection.execute_wrapper(self._pause) if self.pause_on else None
            with hook or contextlib.nullcontext():
                self.result = self.target()
        except BaseException as exc:
            self.error = exc
        finally:
            self.started_sql.set()
            self.paused.set()
            connection.close()

    def wait_paused(self) -> None:
        assert self.paused.wait(WAIT) and self.is_alive() and self.error is None, self.error

    def resume(self) -> None:
        self.resumed.set()

    def finish(self) -> Any:
        self.join(WAIT)
        assert not self.is_alive(), "worker still running"
        if self.error is not None:
            raise self.error
        return self.result

    def wait_blocked_or_done(self) -> None:
        """Until this worker waits on a row lock, or has finished."""
        assert self.started_sql.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while self.is_alive():
            if waits_on_lock(self.pid):
                return
            assert time.monotonic() < deadline, "worker neither blocked nor finished"
            time.sleep(lock_poll())


@contextlib.contextmanager
def after_first(text: str, action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` right after this connection's first statement containing ``text``."""
    done = threading.Event()

    def hook(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if text in sql and not done.is_set():
            done.set()
            action()
        return result

    with connection.execute_wrapper(hook):
        yield
    assert done.is_set(), f"no statement contained {text!r}"


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
