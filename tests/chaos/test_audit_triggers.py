"""The chaos audit's triggers, on the race that creates and deletes a counter row in one
ledgered transaction.

A write that creates a counter row whose parent another transaction deletes
meanwhile deletes that row again and drops its delta: the audit sees the row
inserted and deleted, and the ledger row counts neither. Those changes net to
nothing, and a row deleted with its parent (a ``CASCADE``, no ledger row) is
no change to ledger: the audit finds no violation in either.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from django.db import connection

from counters.models import FlushBatch
from notifications.models import Notification, UnreadCounter
from tests.chaos import audit
from tests.helpers import Worker, after_first, stored, truth

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="the audit's triggers are PostgreSQL's"
    ),
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
]


@pytest.fixture
def audited() -> Iterator[None]:
    audit.install(["unread"])
    yield
    audit.uninstall()


def audited_changes(key: int) -> list[tuple[int, bool]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT delta, deleted FROM chaos_counter_audit WHERE key = %s ORDER BY deleted, xid",
            [str(key)],
        )
        return cursor.fetchall()


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_row_created_for_a_parent_deleted_meanwhile_nets_to_nothing(
    audited, redis_down_in, make_user
):
    redis_down_in.add(threading.current_thread())  # the deltas go to the database directly
    bob, carol = make_user(), make_user()
    Notification.objects.create(recipient=bob, verb="v")
    carol_pk = carol.pk
    deleter = Worker(carol.delete)

    def delete_carol() -> None:
        deleter.start()
        deleter.finish()

    # carol is deleted after the write inserted her counter row, before it checked her.
    with after_first(f'INSERT INTO "{UnreadCounter._meta.db_table}"', delete_carol):
        Notification.objects.bulk_create(
            [Notification(recipient=bob, verb="v") for _ in range(5)]
            + [Notification(recipient=carol, verb="v") for _ in range(2)]
        )
    row = FlushBatch.objects.get(kind=FlushBatch.Kind.FALLBACK, dropped__gt=0)
    assert (row.keys, row.deltas, row.dropped) == (1, 5, 1)
    assert audited_changes(carol_pk) == [(2, False), (-2, True)]
    assert stored(bob) == truth(bob) == 6
    assert audit.violations(["unread"]) == {}

    bob_pk = bob.pk
    bob.delete()  # his counter row goes with him: a deletion outside any ledgered transaction
    assert audited_changes(bob_pk) == [(1, False), (5, False), (-6, True)]
    assert not UnreadCounter.objects.filter(user_id=bob_pk).exists()
    assert audit.violations(["unread"]) == {}
