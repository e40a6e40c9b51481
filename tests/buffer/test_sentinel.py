"""COUNTERS_REDIS_SENTINELS: the settings, their checks, the client built from them, and what
it raises when no master can be found, against real sentinels.

Every module marked ``usefixtures("redis_backend")`` also runs through the
session's sentinels (its ``redis-sentinel`` ids); a master failover under
writers is in tests/flushing/test_sentinel_failover.py and
tests/chaos/test_sentinel_failover.py.
"""

from __future__ import annotations

import pytest
from django.core.checks import Error
from redis import Redis
from redis.sentinel import SentinelConnectionPool

import counters
from counters import client as client_module
from counters.base import conf
from counters.base.exceptions import BufferUnavailable, NotConnected
from counters.buffer.connections import SentinelTcpConnection, SentinelTlsConnection
from counters.buffer.sentinel import master_options, sentinel_addresses
from counters.checks import check_redis_reachable, check_settings
from counters.models import FlushBatch
from counters.write.delivery import may_have_left
from notifications.models import Notification
from tests.helpers import assert_exact, stored, truth

SENTINELS = ["10.0.0.1:26379", "10.0.0.2:26380", "sentinel-3"]


@pytest.fixture(autouse=True)
def clean_config(settings, monkeypatch):
    for name in ("COUNTERS_REDIS_SENTINELS", "COUNTERS_REDIS_SENTINEL_SERVICE"):
        monkeypatch.delenv(name, raising=False)
        if hasattr(settings, name):
            delattr(settings, name)


# -- settings and checks ---------------------------------------------------------------


def test_off_by_default():
    assert conf.redis_sentinels() == []
    assert conf.redis_sentinel_service() == "mymaster"
    assert check_settings() == []


def test_the_environment_lists_sentinels_comma_separated(monkeypatch):
    monkeypatch.setenv("COUNTERS_REDIS_SENTINELS", "10.0.0.1:26379, 10.0.0.2:26380,")
    monkeypatch.setenv("COUNTERS_REDIS_SENTINEL_SERVICE", "counters")
    assert conf.redis_sentinels() == ["10.0.0.1:26379", "10.0.0.2:26380"]
    assert conf.redis_sentinel_service() == "counters"


def test_sentinel_addresses():
    assert sentinel_addresses([*SENTINELS, " [::1]:26381 ", "[fe80::1]"]) == [
        ("10.0.0.1", 26379),
        ("10.0.0.2", 26380),
        ("sentinel-3", 26379),
        ("::1", 26381),
        ("fe80::1", 26379),
    ]


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        pytest.param("10.0.0.1:0", "has no valid port", id="port-0"),
        pytest.param("10.0.0.1:65536", "has no valid port", id="port-too-big"),
        pytest.param("10.0.0.1:x", "has no valid port", id="port-text"),
        pytest.param(":26379", "is not a sentinel address", id="no-host"),
        pytest.param("::1:26379", "is not a sentinel address", id="ipv6-without-brackets"),
        pytest.param("redis://10.0.0.1:26379", "is not a sentinel address", id="url"),
        pytest.param("('10.0.0.1', 26379)", "is not a sentinel address", id="tuple-text"),
    ],
)
def test_a_bad_sentinel_is_e080(settings, entry, problem):
    settings.COUNTERS_REDIS_SENTINELS = ["10.0.0.9:26379", entry]
    [error] = check_settings()
    assert error.id == "counters.E080"
    assert f"{entry!r} {problem}" in error.msg
    with pytest.raises(ValueError, match=problem):
        sentinel_addresses(["10.0.0.9:26379", entry])


def test_sentinels_that_are_not_a_list_are_e080(settings):
    settings.COUNTERS_REDIS_SENTINELS = 26379
    assert check_settings() == [
        Error(
            "COUNTERS_REDIS_SENTINELS must be a list of host:port, got 26379.",
            id="counters.E080",
        )
    ]


@pytest.mark.parametrize("service", ["", "my master", None], ids=["empty", "space", "none"])
def test_a_bad_service_name_is_e081(settings, service):
    settings.COUNTERS_REDIS_SENTINELS = SENTINELS
    settings.COUNTERS_REDIS_SENTINEL_SERVICE = service
    assert [e.id for e in check_settings()] == ["counters.E081"]


def test_sentinels_and_a_cluster_are_e082(settings):
    settings.COUNTERS_REDIS_SENTINELS = SENTINELS
    settings.COUNTERS_REDIS_CLUSTER = True
    assert [e.id for e in check_settings()] == ["counters.E082"]
    with pytest.raises(ValueError, match="exclude each other"):
        client_module._make_client("redis://x/0", 1.0, True, tuple(SENTINELS), "mymaster")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        pytest.param("unix:///run/redis.sock", "needs a redis://, rediss://", id="unix"),
        pytest.param("redis://a/0,redis://b/0", "lists several URLs", id="several"),
    ],
)
def test_a_url_the_master_cannot_have_is_e009(settings, url, problem):
    settings.COUNTERS_REDIS_SENTINELS = SENTINELS
    settings.COUNTERS_REDIS_URL = url
    [error] = check_settings()
    assert error.id == "counters.E009"
    assert problem in error.msg


def test_the_url_gives_the_masters_credentials_database_and_tls():
    assert master_options("valkeys://user:secret@ignored:1234/3?ssl_cert_reqs=none") == {
        "username": "user",
        "password": "secret",
        "db": 3,
        "ssl_cert_reqs": "none",
    }
    assert master_options("redis://mymaster") == {}


# -- the client ------------------------------------------------------------------------


def test_the_client_talks_to_the_master_the_sentinels_name(settings):
    settings.COUNTERS_REDIS_SENTINELS = SENTINELS
    settings.COUNTERS_REDIS_SENTINEL_SERVICE = "counters"
    settings.COUNTERS_REDIS_URL = "redis://:secret@sentinel-master/2"
    settings.COUNTERS_SOCKET_TIMEOUT = 0.7
    client = counters.get_client()
    assert isinstance(client, Redis)
    assert client is counters.get_buffer().client
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert (pool.service_name, pool.is_master) == ("counters", True)
    assert pool.connection_class is SentinelTcpConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["password"], kwargs["db"]) == ("secret", 2)
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.7, 0.7)
    assert kwargs["retry"].get_retries() == 0  # a repeat is the caller's decision
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [26379, 26380, 26379]
    for sentinel in sentinels:
        assert sentinel.connection_pool.connection_kwargs["socket_timeout"] == 0.7
        assert sentinel.connection_pool.connection_kwargs["retry"].get_retries() == 0
    settings.COUNTERS_REDIS_URL = "valkeys://sentinel-master/0"
    assert counters.get_client().connection_pool.connection_class is SentinelTlsConnection


@pytest.mark.redis
@pytest.mark.django_db
def test_no_sentinel_answering_is_not_connected_and_nothing_was_sent(settings):
    settings.COUNTERS_REDIS_SENTINELS = ["127.0.0.1:1", "127.0.0.1:2"]
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    with pytest.raises(NotConnected, match="No master found for 'mymaster'") as raised:
        counters.get_buffer().push({"unread:1": 1}, "push-1")
    assert not may_have_left(raised.value)
    where = "'mymaster' via sentinels 127.0.0.1:1,127.0.0.1:2"
    with pytest.raises(BufferUnavailable, match=f"^Redis unreachable at {where}: No master"):
        counters.flush()
    [warning] = check_redis_reachable()
    assert (warning.id, warning.msg.startswith(f"Redis is unreachable at {where}: ")) == (
        "counters.W001",
        True,
    )


@pytest.mark.redis
@pytest.mark.redis_sentinel
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_service_no_sentinel_knows_falls_back_to_the_database(
    settings, redis_sentinel_set, make_user
):
    """Sentinels that answer but name no master (a wrong service name, or a failover under
    way): the commit writes its deltas to the database, nothing raises, counts stay exact."""
    settings.COUNTERS_REDIS_SENTINELS = redis_sentinel_set.sentinels
    settings.COUNTERS_REDIS_SENTINEL_SERVICE = "no-such-service"
    settings.COUNTERS_REDIS_URL = redis_sentinel_set.url
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    user = make_user()
    for _ in range(3):
        Notification.objects.create(recipient=user, verb="hello")
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count() == 3
    assert stored(user) == truth(user) == 3
    settings.COUNTERS_REDIS_SENTINEL_SERVICE = redis_sentinel_set.service
    Notification.objects.create(recipient=user, verb="through the master")
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count() == 3
    assert_exact(user)
    assert stored(user) == 4
