"""Shared fixtures.

Integration tests use the real Redis at REDIS_URL and the configured database
(SQLite by default, PostgreSQL when DATABASE_URL points at it). Each test gets
its own Redis key prefix, removed afterwards, so runs never see each other.

A module that marks its tests with ``pytest.mark.usefixtures("redis_backend")``
runs each of them twice: on that single Redis, and on a Redis Cluster of six
redis-server processes that the suite starts once, at the first test that
needs it (``-m "not redis_cluster"`` leaves the cluster runs out).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import fakeredis
import pytest
from django.db import connection

import counters
from counters import client as client_module
from counters.base import conf
from counters.buffer.cluster import ClusterClient
from counters.write import sender
from tests.redis_cluster import RedisCluster as RedisClusterServer

pytest.register_assert_rewrite("tests.helpers")

#: Folders whose every test starts processes, kills them or times things (marker ``serial``).
SERIAL_FOLDERS = ("chaos", "e2e", "bench")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests of :data:`SERIAL_FOLDERS` ``serial``: ``make test`` runs them in a pass
    of their own after the parallel one, so their timing never competes with other tests."""
    root = config.rootpath / "tests"
    for item in items:
        parts = item.path.relative_to(root).parts if item.path.is_relative_to(root) else ()
        if parts and parts[0] in SERIAL_FOLDERS:
            item.add_marker(pytest.mark.serial)


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


@pytest.fixture(autouse=True)
def counters_prefix(settings) -> Iterator[str]:
    """A Redis key prefix of this test alone."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    settings.COUNTERS_KEY_PREFIX = prefix
    yield prefix
    sender.reset()  # deltas a per-process sender still holds go to this test's prefix
    key = (conf.redis_url(), conf.socket_timeout(), conf.redis_cluster())
    client = client_module._clients.get(key)
    if client is not None and not isinstance(client, fakeredis.FakeRedis):
        with contextlib.suppress(Exception):
            _delete_prefix(client, prefix)


@pytest.fixture(scope="session")
def redis_cluster_server() -> Iterator[RedisClusterServer]:
    """A Redis Cluster (3 masters, 3 replicas) shared by the session, started at first use.

    Tests that kill a node start a cluster of their own.
    """
    with RedisClusterServer() as cluster:
        yield cluster


@pytest.fixture(
    params=[
        pytest.param("single", id="redis"),
        pytest.param("cluster", id="cluster", marks=pytest.mark.redis_cluster),
    ]
)
def redis_backend(request, settings) -> str:
    """The test runs on the single Redis, then on the session's Redis Cluster."""
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster_server")
        settings.COUNTERS_REDIS_CLUSTER = True
        settings.COUNTERS_REDIS_URL = cluster.url
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
    monkeypatch.setitem(client_module._clients, (url, conf.socket_timeout(), False), client)
    return client


@pytest.fixture
def make_user(django_user_model):
    counter = iter(range(1_000_000))

    def make(name: str | None = None):
        return django_user_model.objects.create(username=name or f"user{next(counter)}")

    return make


@pytest.fixture
def own_redis(settings):
    """A redis-server of this test alone, which the test may kill and restart."""
    from tests.redis_server import RedisServer

    with RedisServer() as server:
        settings.COUNTERS_REDIS_URL = server.url
        yield server


@pytest.fixture
def snapshot_redis(settings, tmp_path):
    """Like ``own_redis``, with a data directory: the test may SAVE and restart from a snapshot."""
    from tests.redis_server import RedisServer

    data_dir = tmp_path / "redis"
    data_dir.mkdir()
    with RedisServer(data_dir=data_dir) as server:
        settings.COUNTERS_REDIS_URL = server.url
        yield server
