"""The bench's own data: users named ``<prefix>-u<i>``, their counter rows and notifications.

Rows are written with set-based SQL (a recursive CTE: PostgreSQL, SQLite, MySQL and
MariaDB) so a million of them take seconds, and deleted the same way.
"""

from __future__ import annotations

from typing import Any, cast

from django.contrib.auth import get_user_model
from django.db import connection, models
from django.db.models import AutoField, BigAutoField, SmallAutoField
from django.utils import timezone

from counters.models import BufferEpoch, FlushBatch
from notifications.models import Notification, UnreadCounter

from .internals import Buffer, RedisClient, column, model_field

_AUTO = (AutoField, BigAutoField, SmallAutoField)

#: Keys of a shard that hold pending deltas (and when they started to pile up).
PENDING_KEYS = ("pending", "since")


def _qn(name: str) -> str:
    return connection.ops.quote_name(name)


def _series(count: int) -> str:
    """A CTE ``s(i)`` holding 0 .. count - 1 (needs one ``%s`` parameter: count - 1)."""
    return "s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i < %s)"


def _insert_series(count: int, insert: str, select: str, ctes: str = "") -> str:
    """``insert`` (``INSERT INTO t (…)``) of ``select`` over the series ``s`` of :func:`_series`.

    ``ctes`` (``, name AS (…)``) follow the series in the same ``WITH``.

    PostgreSQL and SQLite put the CTE first, MySQL after the INSERT, and cap its
    recursion (``cte_max_recursion_depth``; MariaDB's ``max_recursive_iterations``),
    which is raised for the session here.
    """
    if connection.vendor != "mysql":
        return f"WITH RECURSIVE {_series(count)}{ctes} {insert} {select}"
    mariadb = cast(Any, connection).mysql_is_mariadb
    depth = "max_recursive_iterations" if mariadb else "cte_max_recursion_depth"
    with connection.cursor() as cursor:
        cursor.execute(f"SET SESSION {depth} = {max(1000, int(count) + 1)}")
    return f"{insert} WITH RECURSIVE {_series(count)}{ctes} {select}"


def _concat(text: str, number: str) -> str:
    """SQL text of ``text`` followed by the integer ``number`` (MySQL's ``||`` is OR)."""
    if connection.vendor == "mysql":
        return f"CONCAT({text}, {number})"
    return f"{text} || CAST({number} AS TEXT)"


def user_pattern(prefix: str) -> str:
    return f"{prefix}-u%"


def _user_columns() -> tuple[str, str, str]:
    """(table, id column, username column) of the user model, quoted."""
    model = get_user_model()
    username = model_field(model, model.USERNAME_FIELD)
    return _qn(model._meta.db_table), _qn(column(model_field(model, "pk"))), _qn(column(username))


def _column(model: type[models.Model], field: str) -> str:
    return _qn(column(model_field(model, field)))


def create_users(prefix: str, count: int) -> list[int]:
    """Insert ``count`` users ``<prefix>-u<i>`` with unusable passwords; their ids in order."""
    model = get_user_model()
    columns, values, params = [], [], []
    for field in model._meta.concrete_fields:
        if field.primary_key and isinstance(field, _AUTO):
            continue
        columns.append(_qn(column(field)))
        if field.name == model.USERNAME_FIELD:
            values.append(_concat("%s", "s.i"))
            params.append(f"{prefix}-u")
        else:
            value = "!" if field.name == "password" else field.get_default()
            values.append("%s")
            params.append(field.get_db_prep_save(value, connection))
    sql = _insert_series(
        count,
        f"INSERT INTO {_qn(model._meta.db_table)} ({', '.join(columns)})",
        f"SELECT {', '.join(values)} FROM s",
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [count - 1, *params])
    users = model._default_manager.filter(**{f"{model.USERNAME_FIELD}__startswith": f"{prefix}-u"})
    return list(users.order_by("pk").values_list("pk", flat=True))


def create_user(username: str) -> int:
    model = get_user_model()
    user = model(**{model.USERNAME_FIELD: username})
    user.set_unusable_password()
    user.save()
    return user.pk


def create_counters(prefix: str, user_ids: list[int] | None = None) -> None:
    """A zero counter row for every bench user (or the given ones): the steady state."""
    if user_ids is not None:
        UnreadCounter.objects.bulk_create([UnreadCounter(user_id=pk, count=0) for pk in user_ids])
        return
    user_table, user_id, username = _user_columns()
    columns = f"{_column(UnreadCounter, 'user')}, {_column(UnreadCounter, 'count')}"
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {_qn(UnreadCounter._meta.db_table)} ({columns}) "
            f"SELECT {user_id}, 0 FROM {user_table} WHERE {username} LIKE %s",
            [user_pattern(prefix)],
        )


def insert_notifications(
    recipient: int, unread: int, others: int, prefix: str, read_every: int = 2
) -> None:
    """``unread`` unread notifications for ``recipient`` and ``others`` spread over bench users.

    Every ``read_every``-th notification of the others is read.
    """
    table = _qn(Notification._meta.db_table)
    user_table, user_id, username = _user_columns()
    fields = ("recipient", "verb", "description", "created_at", "is_read")
    columns = ", ".join(_column(Notification, f) for f in fields)
    now = Notification._meta.get_field("created_at").get_db_prep_value(timezone.now(), connection)
    with connection.cursor() as cursor:
        cursor.execute(
            _insert_series(
                unread, f"INSERT INTO {table} ({columns})", "SELECT %s, 'bench', '', %s, %s FROM s"
            ),
            [unread - 1, recipient, now, False],
        )
        if others <= 0:
            return
        cursor.execute(
            f"SELECT COUNT(*) FROM {user_table} WHERE {username} LIKE %s", [user_pattern(prefix)]
        )
        (users,) = cursor.fetchone()
        cursor.execute(
            _insert_series(
                others,
                f"INSERT INTO {table} ({columns})",
                "SELECT u.id, 'bench', '', %s, (s.i %% %s = 0) FROM s JOIN u ON u.rn = s.i %% %s",
                f", u(id, rn) AS (SELECT {user_id}, ROW_NUMBER() OVER (ORDER BY {user_id}) - 1 "
                f"FROM {user_table} WHERE {username} LIKE %s)",
            ),
            [others - 1, user_pattern(prefix), now, read_every, users],
        )


def analyze_after_setup() -> None:
    """Planner statistics of the bench users and their counter rows, just created.

    Without them the statements measured are planned against whatever the
    statistics said before (an empty table after the last run's cleanup, until
    autovacuum catches up): the raw bound of the flush measured 96,000 and
    212,000 keys/s in consecutive runs of one commit.
    """
    for model in (UnreadCounter, get_user_model()):
        analyze(model._meta.db_table)


def vacuum_after_delete() -> None:
    """Reclaim the rows the bench deleted, so the next run starts from a table like this one."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return
    for model in (Notification, UnreadCounter, FlushBatch, get_user_model()):
        analyze(model._meta.db_table)


def analyze(table: str) -> None:
    """Fresh planner statistics (and, on PostgreSQL, a visibility map) for ``table``."""
    if connection.in_atomic_block:
        return
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"VACUUM ANALYZE {_qn(table)}")
        elif connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {_qn(table)}")
            cursor.fetchall()
        else:
            cursor.execute(f"ANALYZE {_qn(table)}")


def delete_bench_data(prefix: str) -> None:
    """Delete the bench users with their notifications and counter rows."""
    user_table, user_id, username = _user_columns()
    users = f"SELECT {user_id} FROM {user_table} WHERE {username} LIKE %s"
    pattern = [f"{prefix}-%"]
    notifications = _qn(Notification._meta.db_table)
    counters = _qn(UnreadCounter._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {notifications} WHERE {_column(Notification, 'recipient')} IN ({users})",
            pattern,
        )
        cursor.execute(
            f"DELETE FROM {counters} WHERE {_column(UnreadCounter, 'user')} IN ({users})", pattern
        )
        cursor.execute(f"DELETE FROM {user_table} WHERE {username} LIKE %s", pattern)


def clear_pending(buffer: Buffer) -> None:
    """Drop every pending delta of ``buffer`` (the bench's own prefix) without flushing it."""
    keys = [buffer.key(shard, name) for shard in range(buffer.shards) for name in PENDING_KEYS]
    buffer.client.delete(*keys)


def delete_epochs(prefix: str) -> None:
    """The epoch rows flushes of the bench prefix remembered in the DB."""
    BufferEpoch.objects.filter(prefix=prefix).delete()


def delete_prefix(client: RedisClient, prefix: str) -> int:
    """Delete every Redis key under ``prefix``; how many there were."""
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])
    return len(keys)
