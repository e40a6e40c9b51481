"""The MySQL/MariaDB statements: one UPDATE for a batch whose rows exist, rows created only for
the keys without one (InnoDB spends an auto-increment value on every row of an
``INSERT … ON DUPLICATE KEY UPDATE``), and the outbox claimed once on either server."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

import counters
from counters.base import backends
from counters.base.registry import get_spec
from counters.models import Outbox
from counters.write import outbox
from counters.write.upserts.mysql import apply_mysql
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.skipif("connection.vendor != 'mysql'", reason="MySQL/MariaDB's applier"),
]


def counter_statements(queries: list[dict]) -> list[str]:
    table = UnreadCounter._meta.db_table
    return [q["sql"].split(" ", 1)[0] for q in queries if table in q["sql"]]


def test_a_batch_whose_rows_exist_is_one_update(make_user):
    users = [make_user() for _ in range(30)]
    Notification.objects.notify(users, verb="v")
    counters.flush()  # creates the rows
    Notification.objects.notify(users[::2], verb="again")
    spec = get_spec("unread")
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        applied, statements = apply_mysql(spec, {u.pk: 1 for u in users[::2]}, "default")
    assert (applied, statements) == ({u.pk for u in users[::2]}, 1)
    assert counter_statements(queries.captured_queries) == ["UPDATE"]
    assert "STRAIGHT_JOIN" in next(
        q["sql"] for q in queries.captured_queries if "UPDATE" in q["sql"]
    )
    counters.flush()  # the notify's own deltas, buffered meanwhile
    assert [UnreadCounter.objects.get(user=u).count for u in users] == [3, 1] * 15


def test_missing_rows_are_created_and_spend_no_auto_increment_on_the_others(settings, make_user):
    settings.COUNTERS_SHARDS = 1  # one batch a flush
    users = [make_user() for _ in range(10)]
    Notification.objects.notify(users[:6], verb="v")
    counters.flush()
    last = UnreadCounter.objects.order_by("-pk").values_list("pk", flat=True).first()
    for _ in range(5):  # five flushes of the six existing rows
        Notification.objects.notify(users[:6], verb="v")
        counters.flush()
    Notification.objects.notify(users, verb="v")  # six rows exist, four are new
    with CaptureQueriesContext(connection) as queries:
        counters.flush()
    # The UPDATE finds 6 of 10 rows: rolled back; the 6 locked, added to; 4 created.
    assert counter_statements(queries.captured_queries) == ["UPDATE", "SELECT", "UPDATE", "INSERT"]
    new = sorted(UnreadCounter.objects.filter(user__in=users[6:]).values_list("pk", flat=True))
    assert new == [last + 1, last + 2, last + 3, last + 4]  # no value spent on updates
    assert_exact(*users)


@pytest.mark.parametrize("server", ["mariadb", "mysql"])
def test_an_outbox_row_is_claimed_once(monkeypatch, server):
    """MariaDB deletes it with ``DELETE … RETURNING``; MySQL, which has none, locks and
    reads it first (that path runs here on MariaDB, which has both statements)."""
    monkeypatch.setattr(backends, "is_mariadb", lambda conn: server == "mariadb")
    with transaction.atomic():
        outbox.write({"unread:7": 2, "unread:8": -1}, "default", "push-1")
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        assert outbox.claim_row("push-1", "default") == {"unread:7": 2, "unread:8": -1}
        assert outbox.claim_row("push-1", "default") is None
    assert not Outbox.objects.exists()
    statements = [
        q["sql"].split(" ", 1)[0] for q in queries.captured_queries if "outbox" in q["sql"]
    ]
    if server == "mariadb":
        assert statements == ["DELETE", "DELETE"]
    else:
        assert statements == ["SELECT", "DELETE", "SELECT"]
