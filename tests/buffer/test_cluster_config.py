"""COUNTERS_REDIS_CLUSTER: the setting, its URL check, a client made without a cluster, and
what a pipeline split over masters raises."""

from __future__ import annotations

import pytest
from django.core.checks import Error
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from counters import client as client_module
from counters.base import conf
from counters.base.exceptions import NotConnected
from counters.buffer.cluster import ClusterClient, node_urls
from counters.buffer.pipelines import NodePipeline, outcome
from counters.checks import check_settings

NODES = "redis://127.0.0.1:7000/0, redis://127.0.0.1:7001/0,redis://127.0.0.1:7002"


@pytest.fixture(autouse=True)
def clean_config(settings, monkeypatch):
    for name in ("COUNTERS_REDIS_CLUSTER", "COUNTERS_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
        if hasattr(settings, name):
            delattr(settings, name)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("on", True), ("0", False), ("no", False), ("", False)],
)
def test_the_environment_turns_it_on(monkeypatch, raw, expected):
    monkeypatch.setenv("COUNTERS_REDIS_CLUSTER", raw)
    assert conf.redis_cluster() is expected


def test_off_by_default():
    assert conf.redis_cluster() is False


def test_a_list_of_nodes_or_one_node_is_a_cluster_url():
    assert node_urls(NODES) == [
        "redis://127.0.0.1:7000/0",
        "redis://127.0.0.1:7001/0",
        "redis://127.0.0.1:7002",
    ]
    assert node_urls("rediss://user:secret@cache:6380") == ["rediss://user:secret@cache:6380"]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        pytest.param("unix:///tmp/redis.sock", "needs a redis:// or rediss:// URL", id="unix"),
        pytest.param("redis://a:7000/0,http://b:7001", "needs a redis:// or rediss://", id="http"),
        pytest.param("redis://a:7000/3", "database 0 only", id="database"),
        pytest.param(" , ", "names no Redis Cluster node", id="empty"),
    ],
)
def test_a_url_no_cluster_node_can_have_is_e009(settings, url, problem):
    settings.COUNTERS_REDIS_CLUSTER = True
    settings.COUNTERS_REDIS_URL = url
    [error] = check_settings()
    assert error.id == "counters.E009"
    assert problem in error.msg
    with pytest.raises(ValueError, match=problem):
        node_urls(url)


def test_cluster_urls_pass_the_checks(settings):
    settings.COUNTERS_REDIS_CLUSTER = True
    settings.COUNTERS_REDIS_URL = NODES
    assert check_settings() == []


def test_a_list_of_urls_without_the_cluster_setting_is_e009(settings):
    settings.COUNTERS_REDIS_URL = NODES
    assert check_settings() == [
        Error(
            f"COUNTERS_REDIS_URL {NODES!r} lists several URLs.",
            hint="A list of nodes names a Redis Cluster: set COUNTERS_REDIS_CLUSTER.",
            id="counters.E009",
        )
    ]


def test_the_client_and_buffer_exist_before_any_node_answers(settings, monkeypatch):
    """Making the client talks to no node: a process starts while the cluster is down."""
    url = "redis://127.0.0.1:1/0,redis://127.0.0.1:2/0"
    settings.COUNTERS_REDIS_CLUSTER = True
    settings.COUNTERS_REDIS_URL = url
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    monkeypatch.setattr(client_module, "_clients", {})
    monkeypatch.setattr(client_module, "_buffers", {})
    monkeypatch.setattr(client_module, "_current", {})
    buffer = client_module.get_buffer()
    assert isinstance(buffer.client, ClusterClient)
    assert buffer.client is client_module.get_client(url, 0.2, True)
    assert isinstance(buffer.client.pipeline(), NodePipeline)
    with pytest.raises(NotConnected, match="no node of the Redis Cluster"):
        buffer.push({"unread:1": 1}, "push-1")
    with pytest.raises(NotConnected):
        buffer.client.get("anything")


def test_a_cluster_pipeline_is_never_a_transaction():
    with pytest.raises(ValueError, match="cannot be a transaction"):
        ClusterClient("redis://127.0.0.1:1/0", 0.2).pipeline(transaction=True)


# -- what a pipeline split over masters raises ---------------------------------------
def _not_connected() -> NotConnected:
    return NotConnected("Error 111 connecting to 127.0.0.1:7000. Connection refused.")


def test_nothing_sent_anywhere_is_not_connected():
    with pytest.raises(NotConnected):
        outcome([_not_connected(), _not_connected()], raise_on_error=True)


def test_a_master_not_reached_while_others_ran_their_part_may_have_left():
    """The write path must not take the whole push for unsent: fence it instead."""
    with pytest.raises(RedisConnectionError, match="1 of 2 commands could not reach") as info:
        outcome([1, _not_connected()], raise_on_error=True)
    assert not isinstance(info.value, NotConnected)


def test_a_timeout_after_sending_is_raised_as_it_is():
    timeout = RedisTimeoutError("Timeout reading from socket")
    with pytest.raises(RedisTimeoutError) as info:
        outcome([_not_connected(), timeout], raise_on_error=True)
    assert info.value is timeout


def test_error_replies_are_raised_or_returned_like_a_pipeline():
    oom = ResponseError("OOM command not allowed")
    with pytest.raises(ResponseError):
        outcome([1, oom], raise_on_error=True)
    assert outcome([1, oom], raise_on_error=False) == [1, oom]
