"""Shared fixtures.

Integration tests use the real Redis at REDIS_URL and the configured database
(SQLite by default, PostgreSQL when DATABASE_URL points at it). Each test gets
its own Redis key prefix, removed afterwards, so runs never see each other.

A module that marks its tests with ``pytest.mark.usefixtures("redis_backend")``
runs each of them on that single Redis and on a Redis Cluster of six
redis-server processes; in the folders that talk to Redis (:data:`SENTINEL_FOLDERS`)
also through three sentinels watching a master and its replica
(``COUNTERS_REDIS_SENTINELS``). The suite starts the cluster and the sentinel
set once, at the first test that needs them (``-m "not redis_cluster"`` and
``-m "not redis_sentinel"`` leave those runs out).

``TALLY_REDIS_SERVER=valkey`` runs all of it on Valkey instead: the Redis at
REDIS_URL is replaced by a ``valkey-server`` of the session, under a
``valkey://`` URL, and every server the tests start (their own, the cluster's
nodes, the sentinel set) is a ``valkey-server``; the backends' ids say
``valkey``. ``make test-valkey`` runs the tests that talk to Redis that way.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
from django.db import connection

import counters
from counters import client as client_module
from counters.base.exceptions import NotConnected
from counters.buffer import live
from counters.buffer.cluster import ClusterClient
from counters.buffer.store import Buffer
from counters.write import sender
from tests.redis_cluster import RedisCluster as RedisClusterServer
from tests.redis_sentinel import SentinelSet
from tests.redis_server import SERVER, RedisServer

pytest.register_assert_rewrite("tests.helpers")

#: Folders whose every test starts processes, kills them or times things (marker ``serial``).
SERIAL_FOLDERS = ("chaos", "e2e", "bench")


#: Folders whose ``redis_backend`` tests also run through Sentinel: those that talk to Redis
#: (and the flush command's). Elsewhere (the ORM capture of tracking/) the backend changes
#: nothing a single Redis and a cluster do not already show.
SENTINEL_FOLDERS = ("buffer", "flushing", "write", "read", "app")


def _quick_test_flush() -> None:
    """The flush that empties every table after a transactional test (Django's ``flush``
    command), made cheaper in two ways; the tables it empties are as empty as before.

    - The content types and permissions are kept. Django emits ``post_migrate`` after
      the flush, whose receivers insert them again when the flush emptied their tables: a
      few hundred rows after every test. They are the same for the whole session (no test
      adds or removes a model), so the receivers find them there.
    - On PostgreSQL, a ``DELETE`` of each table with the foreign key triggers off for the
      transaction (``session_replication_role``, a superuser's setting), as Django's MySQL
      backend does, not one ``TRUNCATE`` of every table, which gives each table and index
      a new file: some 0.15 s a test here, about a third of the PostgreSQL runs. Without
      superuser rights, or to reset sequences, Django's own statements.
    """
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from django.core.management.commands import flush

    kept = {ContentType._meta.db_table, Permission._meta.db_table}

    def sql_flush(style, connection, reset_sequences=True, allow_cascade=False):
        tables = connection.introspection.django_table_names(
            only_existing=True, include_views=False
        )
        tables = [table for table in tables if table not in kept]
        if tables and not reset_sequences and _postgresql_superuser(connection):
            qn = connection.ops.quote_name
            return [
                "SET LOCAL session_replication_role = replica",
                *(f"DELETE FROM {qn(table)}" for table in tables),
            ]
        return connection.ops.sql_flush(
            style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )

    flush.sql_flush = sql_flush


def _postgresql_superuser(connection) -> bool:
    """Is ``connection`` to PostgreSQL, as a superuser? (Asked once per connection.)"""
    if connection.vendor != "postgresql":
        return False
    superuser = connection.__dict__.get("_tests_superuser")
    if superuser is None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            superuser = connection.__dict__["_tests_superuser"] = bool(cursor.fetchone()[0])
    return superuser


_quick_test_flush()


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests of :data:`SERIAL_FOLDERS` ``serial``: ``make test`` runs them in a pass
    of their own after the parallel one, so their timing never competes with other tests.
    Leave out the Sentinel runs of ``redis_backend`` tests outside :data:`SENTINEL_FOLDERS`."""
    root = config.rootpath / "tests"
    kept, dropped = [], []
    for item in items:
        parts = item.path.relative_to(root).parts if item.path.is_relative_to(root) else ()
        if parts and parts[0] in SERIAL_FOLDERS:
            item.add_marker(pytest.mark.serial)
        callspec = getattr(item, "callspec", None)
        sentinel = callspec is not None and callspec.params.get("redis_backend") == "sentinel"
        if sentinel and not (parts and parts[0] in SENTINEL_FOLDERS):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


def has_row_locks() -> bool:
    """Whether the database locks rows, so that connections queue on each other's rows
    (PostgreSQL, MySQL/MariaDB with InnoDB); SQLite locks the whole database."""
    return connection.vendor in ("postgresql", "mysql")


def _delete_prefix(client, prefix: str) -> None:
    # "<prefix>:*" and the buffers of other databases, "<prefix>.<alias>:*"; on a cluster,
    # on every master (SCAN sees one node's keys)
    if isinstance(client, ClusterClient):
        nodes = [client.get_redis_connection(n) for n in client.get_primaries()]
    else:
        nodes = [client]
    for node in nodes:
        keys = list(node.scan_iter(match=f"{prefix}[:.]*", count=1000))
        pipe = node.pipeline(transaction=False)
        for key in keys:
            pipe.delete(key)  # one key a command: each key has a slot of its own
        pipe.execute()


@pytest.fixture(scope="session")
def suite_redis_url() -> Iterator[str | None]:
    """Under ``TALLY_REDIS_SERVER=valkey``: the URL of a valkey-server of this session (one
    per xdist worker), which stands for the Redis at REDIS_URL, here and in subprocesses.
    None on Redis: the suite uses REDIS_URL as it is."""
    if SERVER == "redis":
        yield None
        return
    with RedisServer() as server, pytest.MonkeyPatch.context() as patch:
        url = f"valkey://127.0.0.1:{server.port}/0"
        patch.setenv("REDIS_URL", url)
        yield url


@pytest.fixture(autouse=True)
def counters_prefix(settings, suite_redis_url) -> Iterator[str]:
    """A Redis key prefix of this test alone."""
    if suite_redis_url is not None:
        settings.REDIS_URL = suite_redis_url
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    settings.COUNTERS_KEY_PREFIX = prefix
    yield prefix
    sender.reset()  # deltas a per-process sender still holds go to this test's prefix
    with contextlib.suppress(Exception):  # the test may have left settings a client refuses
        client = client_module._clients.get(client_module.client_key())
        if client is not None and not isinstance(client, fakeredis.FakeRedis):
            _delete_prefix(client, prefix)


@pytest.fixture
def per_commit(settings) -> None:
    """Every COMMIT pushes its own deltas (``COUNTERS_SEND_DELAY_MS = 0``) whatever the
    default, for the tests of what one commit's push does: its route, its reply, its
    fallback to the database, its fencing (the per-process sender would merge it)."""
    settings.COUNTERS_SEND_DELAY_MS = 0


@pytest.fixture(autouse=True)
def live_counters(request, monkeypatch) -> set[str]:
    """The live counters of this test: none, so that the push path's tests keep testing the
    path of a counter that is not live, unless the test is marked ``live`` (the example's
    own, ``unread``, is live in its processes: the ones the tests start keep it live)."""
    names = set(live.LIVE_COUNTERS) if request.node.get_closest_marker("live") else set()
    monkeypatch.setattr(live, "LIVE_COUNTERS", names)
    return names


@pytest.fixture(scope="session")
def redis_cluster_server() -> Iterator[RedisClusterServer]:
    """A Redis Cluster (3 masters, 3 replicas) shared by the session, started at first use.

    Tests that kill a node start a cluster of their own.
    """
    with RedisClusterServer() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel_set() -> Iterator[SentinelSet]:
    """A master, its replica and three sentinels shared by the session, started at first use.

    Tests that fail the master over start a set of their own. This one waits 30 s before it
    deems the master down, so that a loaded machine never fails it over under a test.
    """
    with SentinelSet(down_after_ms=30_000) as sentinels:
        yield sentinels


@pytest.fixture(
    params=[
        pytest.param("single", id=SERVER),
        pytest.param(
            "cluster",
            id="cluster" if SERVER == "redis" else f"{SERVER}-cluster",
            marks=pytest.mark.redis_cluster,
        ),
        pytest.param("sentinel", id=f"{SERVER}-sentinel", marks=pytest.mark.redis_sentinel),
    ]
)
def redis_backend(request, settings) -> str:
    """The test runs on the single Redis, on the session's Redis Cluster, then through the
    session's sentinels (on Valkey's under ``TALLY_REDIS_SERVER=valkey``)."""
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster_server")
        settings.COUNTERS_REDIS_CLUSTER = True
        settings.COUNTERS_REDIS_URL = cluster.url
    elif request.param == "sentinel":
        sentinels = request.getfixturevalue("redis_sentinel_set")
        settings.COUNTERS_REDIS_SENTINELS = sentinels.sentinels
        settings.COUNTERS_REDIS_SENTINEL_SERVICE = sentinels.service
        settings.COUNTERS_REDIS_URL = sentinels.url
    return request.param


@pytest.fixture
def redis_client(settings):
    """The real Redis client the counters app uses in this test."""
    client = counters.get_client()
    client.ping()
    return client


@pytest.fixture
def fake_redis(settings, monkeypatch) -> fakeredis.FakeRedis:
    """Point the counters app at an in-process fakeredis server."""
    url = "redis://fakeredis:6379/0"
    settings.COUNTERS_REDIS_URL = url
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    monkeypatch.setitem(client_module._clients, client_module.client_key(url), client)
    return client


@pytest.fixture
def quick_confirm(monkeypatch) -> float:
    """Rebuilds and audits that are not given a confirm delay wait ``QUICK_CONFIRM`` s
    between readings (the flush's rebuild, ``counters_rebuild`` in this process): for tests
    with no writer running beside them."""
    from counters.verify import audit, hold, rebuild
    from tests.helpers import QUICK_CONFIRM

    for module in (audit, hold, rebuild):
        monkeypatch.setattr(module, "default_confirm_delay", lambda: QUICK_CONFIRM)
    return QUICK_CONFIRM


@pytest.fixture
def make_user(django_user_model):
    counter = iter(range(1_000_000))

    def make(name: str | None = None):
        return django_user_model.objects.create(username=name or f"user{next(counter)}")

    return make


@pytest.fixture
def own_redis(settings):
    """A redis-server of this test alone, which the test may kill and restart."""
    with RedisServer() as server:
        settings.COUNTERS_REDIS_URL = server.url
        yield server


@pytest.fixture
def snapshot_redis(settings, tmp_path):
    """Like ``own_redis``, with a data directory: the test may SAVE and restart from a snapshot."""
    data_dir = tmp_path / "redis"
    data_dir.mkdir()
    with RedisServer(data_dir=data_dir) as server:
        settings.COUNTERS_REDIS_URL = server.url
        yield server


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
