"""Shared fixtures.

Integration tests use the real Redis at REDIS_URL and the configured database
(SQLite by default, PostgreSQL when DATABASE_URL points at it). Each test gets
its own Redis key prefix, removed afterwards, so runs never see each other.
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
from counters import conf

pytest.register_assert_rewrite("tests.helpers")


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


def _delete_prefix(client, prefix: str) -> None:
    # "<prefix>:*" and the buffers of other databases, "<prefix>.<alias>:*"
    keys = list(client.scan_iter(match=f"{prefix}[:.]*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])


@pytest.fixture(autouse=True)
def counters_prefix(settings) -> Iterator[str]:
    """A Redis key prefix of this test alone."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    settings.COUNTERS_KEY_PREFIX = prefix
    yield prefix
    client = client_module._clients.get((conf.redis_url(), conf.socket_timeout()))
    if client is not None and not isinstance(client, fakeredis.FakeRedis):
        with contextlib.suppress(Exception):
            _delete_prefix(client, prefix)


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
    monkeypatch.setitem(client_module._clients, (url, conf.socket_timeout()), client)
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
