"""The databases the counters app runs on, and what each needs: read by ``check`` at start.

Every applier, reader and lock of the app has its statements for PostgreSQL,
SQLite and MySQL/MariaDB (InnoDB); any other database is refused before a
row is written. On MySQL and MariaDB the app's reasoning assumes what
PostgreSQL gives by default: READ COMMITTED (every statement sees what
committed before it, so a reading retried inside a transaction sees a flush
that committed meanwhile), transactions (InnoDB), and a BIGINT overflow that
fails its statement (strict mode) instead of being clamped.
"""

from __future__ import annotations

from typing import Any

from django.db import connections

#: ``connection.vendor`` of each database the app supports.
SUPPORTED_VENDORS = ("postgresql", "sqlite", "mysql")
#: The only MySQL isolation level the app supports (Django's default for MySQL).
MYSQL_ISOLATION = "read committed"


def is_mariadb(conn: Any) -> bool:
    """Whether ``conn`` is Django's MySQL backend on a MariaDB server (it asks the server once)."""
    return conn.vendor == "mysql" and bool(conn.mysql_is_mariadb)


def any_mysql() -> bool:
    """Whether a configured database is MySQL or MariaDB (read from the settings alone)."""
    return any(connections[alias].vendor == "mysql" for alias in connections)


def unsupported(alias: str, conn: Any) -> str | None:
    """Why database ``alias`` cannot hold counters, or None if it can."""
    if conn.vendor in SUPPORTED_VENDORS:
        return None
    return (
        f"database {alias!r} ({conn.display_name}, engine {conn.settings_dict['ENGINE']!r}) "
        "is not supported by the counters app: it runs on PostgreSQL, SQLite, MySQL 8.0+ "
        "and MariaDB 10.11+"
    )


def mysql_isolation(alias: str, conn: Any) -> str | None:
    """Why the isolation level of MySQL database ``alias`` does not fit, or None."""
    if conn.vendor != "mysql":
        return None
    options = conn.settings_dict.get("OPTIONS") or {}
    level = options.get("isolation_level", MYSQL_ISOLATION)
    if level is not None and str(level).lower() == MYSQL_ISOLATION:
        return None
    shown = "the server's default (REPEATABLE READ unless changed)" if level is None else level
    return (
        f"database {alias!r} runs at isolation level {shown!r}: the counters app needs "
        f"{MYSQL_ISOLATION!r}, where each statement sees what committed before it "
        "(a reading retried inside a transaction must see a flush committed meanwhile)"
    )


def mysql_storage(alias: str, conn: Any) -> str | None:
    """Why the tables of MySQL database ``alias`` cannot hold counters (not InnoDB), or None.

    Connects to the database: only for ``check --database``.
    """
    if conn.vendor != "mysql":
        return None
    with conn.cursor() as cursor:  # the session's value: OPTIONS['init_command'] may set it
        cursor.execute("SELECT @@default_storage_engine")
        engine = cursor.fetchone()[0]
    if engine == "InnoDB":
        return None
    return (
        f"database {alias!r} creates its tables with the {engine} storage engine: the "
        "counters app needs InnoDB (transactions, row locks)"
    )


#: Check id and hint of each problem (``check_databases`` in counters/checks.py).
HINTS = {
    "counters.E090": "Keep the counters app's tables in a supported database (a database "
    "router's allow_migrate for the app label 'counters').",
    "counters.E091": "Remove OPTIONS['isolation_level'] (Django's default for MySQL is 'read "
    "committed') or set it to 'read committed'.",
    "counters.E092": "Set default_storage_engine=InnoDB (OPTIONS['init_command']) before "
    "migrating, or ALTER TABLE … ENGINE=InnoDB.",
}


def problems(alias: str, conn: Any, connect: bool = False) -> list[tuple[str, str, str]]:
    """``(check id, reason, hint)`` of each problem of database ``alias``.

    ``connect``: also the checks that query the database (the storage engine).
    """
    reason = unsupported(alias, conn)
    if reason:
        return [("counters.E090", reason, HINTS["counters.E090"])]
    found = [("counters.E091", mysql_isolation(alias, conn))]
    if connect:
        found.append(("counters.E092", mysql_storage(alias, conn)))
    return [(check_id, why, HINTS[check_id]) for check_id, why in found if why]
