"""``check`` refuses a database the counters app has no statements for (E090), a MySQL
database not at READ COMMITTED (E091) and, with ``--database``, MySQL tables not in InnoDB
(E092): before any row is written, not at the first flush."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.db import connection
from django.db.utils import ConnectionHandler

from counters.checks import project as checks
from tests.procs import ROOT, project_env

SQLITE = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}


def mysql(**options) -> dict:
    return {"ENGINE": "django.db.backends.mysql", "NAME": "tally", "OPTIONS": options}


@pytest.fixture
def databases(monkeypatch, settings):
    """Run the check over the databases given (none is connected to)."""

    def use(**aliases: dict) -> list:
        handler = ConnectionHandler({"default": SQLITE, **aliases})
        monkeypatch.setattr(checks, "connections", handler)
        settings.COUNTERS_DATABASES = None
        return [(m.id, m.msg) for m in checks.check_databases()]

    return use


def test_manage_py_check_refuses_an_oracle_database():
    env = project_env()
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings_oracle"
    done = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert (
        "?: (counters.E090) database 'legacy' (Oracle, engine 'tests.oracle_like') is not "
        "supported by the counters app: it runs on PostgreSQL, SQLite, MySQL 8.0+ and "
        "MariaDB 10.11+"
    ) in done.stderr, done.stderr
    assert "allow_migrate for the app label 'counters'" in done.stderr


def test_a_database_router_keeping_the_app_out_of_oracle_passes(databases, settings):
    settings.DATABASE_ROUTERS = ["tests.app.test_database_checks.NotOnLegacy"]
    assert databases(legacy={"ENGINE": "tests.oracle_like", "NAME": "legacy"}) == []


class NotOnLegacy:
    def allow_migrate(self, db, app_label, **hints):
        return db != "legacy"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        pytest.param({}, [], id="django-default"),
        pytest.param({"isolation_level": "read committed"}, [], id="read-committed"),
        pytest.param({"isolation_level": "READ COMMITTED"}, [], id="upper-case"),
        pytest.param({"isolation_level": "repeatable read"}, ["'repeatable read'"], id="rr"),
        pytest.param({"isolation_level": "serializable"}, ["'serializable'"], id="serializable"),
        pytest.param(
            {"isolation_level": None},
            ['"the server\'s default (REPEATABLE READ unless changed)"'],
            id="server-default",
        ),
    ],
)
def test_mysql_must_run_at_read_committed(databases, options, expected):
    found = databases(shop=mysql(**options))
    assert [check_id for check_id, _ in found] == ["counters.E091"] * len(expected)
    for (_, message), level in zip(found, expected, strict=True):
        assert message == (
            f"database 'shop' runs at isolation level {level}: the counters app needs "
            "'read committed', where each statement sees what committed before it (a reading "
            "retried inside a transaction must see a flush committed meanwhile)"
        )


@pytest.mark.django_db
@pytest.mark.skipif("connection.vendor != 'mysql'", reason="reads MySQL's storage engine")
def test_mysql_tables_must_be_innodb():
    assert checks.check_databases(databases=["default"]) == []
    with connection.cursor() as cursor:  # what OPTIONS['init_command'] would set
        cursor.execute("SET SESSION default_storage_engine = MyISAM")
    try:
        [error] = checks.check_databases(databases=["default"])
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION default_storage_engine = InnoDB")
    assert error.id == "counters.E092"
    assert error.msg == (
        "database 'default' creates its tables with the MyISAM storage engine: the counters "
        "app needs InnoDB (transactions, row locks)"
    )
