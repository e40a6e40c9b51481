"""The ``trigger`` write mode: a PostgreSQL trigger keeps the same unread counter rows as Tally.

It is the counter a Django team would write first (Lemmy keeps its counts so,
django-pgtrigger makes it one declaration): ``AFTER INSERT ... WHEN (NOT
NEW.is_read)``, an upsert of the recipient's row that adds 1. The writers
insert with Tally paused, as in ``off``, so only the trigger counts.

The trigger is created right before each run of the mode and dropped right
after it, also when the run fails: the other modes insert into the same table.
After each run the counter rows are checked, user by user, against the unread
rows the run inserted. A trigger left by a bench that was killed meanwhile is
dropped at the start of the next one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction

from notifications.models import Notification, UnreadCounter

from .internals import column, model_field

#: Trigger and function names: ``bench_<hex of the run's key prefix>_unread``.
NAME_PATTERN = r"bench\_%\_unread"


def unsupported() -> str | None:
    """Why the mode cannot run on this database, or None."""
    if connection.vendor == "postgresql":
        return None
    return (
        "trigger mode skipped: it is a PostgreSQL trigger, and the database is "
        f"{connection.display_name}"
    )


def _qn(name: str) -> str:
    return connection.ops.quote_name(name)


def _col(model: type, field: str) -> str:
    return _qn(column(model_field(model, field)))


NOTIFICATIONS = _qn(Notification._meta.db_table)
COUNTERS = _qn(UnreadCounter._meta.db_table)


def _drop(cursor, name: str) -> None:
    cursor.execute(f"DROP TRIGGER IF EXISTS {_qn(name)} ON {NOTIFICATIONS}")
    cursor.execute(f"DROP FUNCTION IF EXISTS {_qn(name)}()")


def drop_leftovers() -> list[str]:
    """Drop the triggers of bench runs that were killed while theirs was installed."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal "
            "AND tgname LIKE %s ORDER BY tgname",
            [Notification._meta.db_table, NAME_PATTERN],
        )
        names = [name for (name,) in cursor.fetchall()]
        for name in names:
            _drop(cursor, name)
    return names


def trigger_name(prefix: str) -> str:
    """The trigger (and function) name of the bench run with key prefix ``prefix``."""
    return prefix.replace("-", "_") + "_unread"


def remove(prefix: str) -> None:
    """Drop the trigger of the run with ``prefix`` if it is still there (PostgreSQL only)."""
    if connection.vendor == "postgresql":
        with transaction.atomic(), connection.cursor() as cursor:
            _drop(cursor, trigger_name(prefix))


class CounterTrigger:
    """The trigger of one bench run, and the check of what it counted."""

    def __init__(self, prefix: str, users: list[int]) -> None:
        self.name = trigger_name(prefix)
        self.users = users
        #: Unread rows inserted while the trigger was installed, and users whose row is off.
        self.rows = 0
        self.users_off = 0

    def _create(self) -> None:
        user, count = _col(UnreadCounter, "user"), _col(UnreadCounter, "count")
        name = _qn(self.name)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ "
                f"BEGIN INSERT INTO {COUNTERS} ({user}, {count}) "
                f"VALUES (NEW.{_col(Notification, 'recipient')}, 1) "
                f"ON CONFLICT ({user}) DO UPDATE SET {count} = {COUNTERS}.{count} + 1; "
                "RETURN NULL; END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER {name} AFTER INSERT ON {NOTIFICATIONS} FOR EACH ROW "
                f"WHEN (NOT NEW.{_col(Notification, 'is_read')}) EXECUTE FUNCTION {name}()"
            )

    def installed(self) -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_trigger WHERE tgrelid = %s::regclass AND tgname = %s",
                [Notification._meta.db_table, self.name],
            )
            return bool(cursor.fetchone()[0])

    @contextmanager
    def counting(self) -> Iterator[None]:
        """The trigger installed around the block, then its counts checked; dropped always."""
        self._create()
        try:
            last_id, before = self._snapshot()
            yield
            self._check(last_id, before)
        finally:
            with transaction.atomic(), connection.cursor() as cursor:
                _drop(cursor, self.name)

    def _counts(self, users: list[int]) -> dict[int, int]:
        user, count = _col(UnreadCounter, "user"), _col(UnreadCounter, "count")
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {user}, {count} FROM {COUNTERS} WHERE {user} = ANY(%s)", [users]
            )
            return dict(cursor.fetchall())

    def _snapshot(self) -> tuple[int, dict[int, int]]:
        """The last notification id, and the counter rows of the bench users."""
        with connection.cursor() as cursor:
            pk = _col(Notification, "pk")
            cursor.execute(f"SELECT COALESCE(MAX({pk}), 0) FROM {NOTIFICATIONS}")
            (last_id,) = cursor.fetchone()
        return last_id, self._counts(self.users)

    def _check(self, last_id: int, before: dict[int, int]) -> None:
        """Each user's row grew by the unread rows inserted for them since ``last_id``."""
        recipient = _col(Notification, "recipient")
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {recipient}, count(*) FROM {NOTIFICATIONS} "
                f"WHERE {_col(Notification, 'pk')} > %s AND NOT {_col(Notification, 'is_read')} "
                f"GROUP BY {recipient}",
                [last_id],
            )
            inserted: dict[int, int] = dict(cursor.fetchall())
        after = self._counts(sorted(set(self.users) | set(inserted)))
        for user in set(before) | set(after) | set(inserted):
            if after.get(user, 0) - before.get(user, 0) != inserted.get(user, 0):
                self.users_off += 1
        self.rows += sum(inserted.values())
