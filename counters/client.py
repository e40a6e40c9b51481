"""Settings → Redis client and Buffer, cached per process; database aliases to flush."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from django.core.signals import setting_changed
from django.db import DEFAULT_DB_ALIAS, connections, router
from django.dispatch import receiver
from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from counters.base import conf
from counters.buffer.cluster import ClusterClient
from counters.buffer.connections import (
    HEALTH_CHECK_INTERVAL,
    TcpConnection,
    TlsConnection,
    UnixConnection,
    connection_class,
    redis_scheme,
)
from counters.buffer.sentinel import sentinel_master
from counters.buffer.store import Buffer

#: What a client is made of: URL, socket timeout, cluster, sentinels, Sentinel service.
ClientKey = tuple[str, float, bool, tuple[str, ...], str]

_lock = threading.Lock()
_clients: dict[ClientKey, Redis | ClusterClient] = {}
_buffers: dict[tuple[ClientKey, str, int], Buffer] = {}
_current: dict[str, Buffer] = {}

__all__ = [
    "ClusterClient",
    "TcpConnection",
    "TlsConnection",
    "UnixConnection",
    "buffer_prefix",
    "client_key",
    "connection_class",
    "flushed_databases",
    "get_buffer",
    "get_client",
]


def get_client(
    url: str | None = None,
    timeout: float | None = None,
    cluster: bool | None = None,
    *,
    sentinels: Sequence[str] | None = None,
    service: str | None = None,
) -> Redis | ClusterClient:
    """A shared client for ``url`` (default: ``COUNTERS_REDIS_URL``).

    With ``cluster`` (default: ``COUNTERS_REDIS_CLUSTER``) the URL names nodes
    of a Redis Cluster, one or several comma-separated, and the client is a
    :class:`~counters.buffer.cluster.ClusterClient`. With ``sentinels``
    (default: ``COUNTERS_REDIS_SENTINELS``) the client talks to the master that
    the sentinels name for ``service`` (``COUNTERS_REDIS_SENTINEL_SERVICE``),
    whichever it is now; the URL gives its credentials and database.
    ``valkey://`` and ``valkeys://`` URLs are read as ``redis://`` and ``rediss://``.

    redis-py's own retries are off: every caller here decides itself whether a
    repeat is safe, and the write path must fall back quickly when Redis is down.
    """
    return _shared_client(client_key(url, timeout, cluster, sentinels, service))


def _shared_client(key: ClientKey) -> Redis | ClusterClient:
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                client = _clients[key] = _make_client(*key)
    return client


def client_key(
    url: str | None = None,
    timeout: float | None = None,
    cluster: bool | None = None,
    sentinels: Sequence[str] | None = None,
    service: str | None = None,
) -> ClientKey:
    """The client's identity, each part missing read from its setting."""
    return (
        url or conf.redis_url(),
        conf.socket_timeout() if timeout is None else timeout,
        conf.redis_cluster() if cluster is None else cluster,
        tuple(conf.redis_sentinels() if sentinels is None else sentinels),
        service or conf.redis_sentinel_service(),
    )


def _make_client(
    url: str, timeout: float, cluster: bool, sentinels: tuple[str, ...], service: str
) -> Redis | ClusterClient:
    if cluster and sentinels:
        raise ValueError(
            "COUNTERS_REDIS_CLUSTER and COUNTERS_REDIS_SENTINELS exclude each other: "
            "a Redis Cluster fails over by itself"
        )
    if cluster:
        return ClusterClient(url, timeout)
    if sentinels:
        return sentinel_master(sentinels, service, url, timeout)
    return Redis.from_url(
        redis_scheme(url),
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=HEALTH_CHECK_INTERVAL,
        connection_class=connection_class(url),
    )


def get_buffer(using: str = DEFAULT_DB_ALIAS) -> Buffer:
    """The Buffer of database ``using``, configured by the ``COUNTERS_*`` settings.

    Each database has a buffer of its own, so deltas go back to the database
    they were recorded on: the key prefix is ``COUNTERS_KEY_PREFIX`` for the
    default database and ``<prefix>.<alias>`` for any other alias.

    Cached for the hot path; a changed setting (``setting_changed``, as sent by
    ``override_settings``) makes the next call read the settings again.
    """
    buffer = _current.get(using)
    if buffer is not None:
        return buffer
    client = client_key()
    prefix, shards = buffer_prefix(using), conf.shards()
    key = (client, prefix, shards)
    buffer = _buffers.get(key)
    if buffer is None:
        buffer = _buffers[key] = Buffer(_shared_client(client), prefix, shards)
    _current[using] = buffer
    return buffer


def buffer_prefix(using: str = DEFAULT_DB_ALIAS) -> str:
    """Key prefix of the buffer of database ``using`` (the default's is the bare prefix)."""
    prefix = conf.key_prefix()
    return prefix if using == DEFAULT_DB_ALIAS else f"{prefix}.{using}"


def flushed_databases() -> list[str]:
    """Aliases that a flush without an alias drains (``COUNTERS_DATABASES``).

    Default: every database the routers let the counters app migrate to.
    """
    configured = conf.configured_databases()
    if configured is not None:
        return configured
    return [alias for alias in connections if router.allow_migrate(alias, "counters")]


@receiver(setting_changed)
def _forget_buffer(setting: str, **kwargs: Any) -> None:
    if setting.startswith("COUNTERS_") or setting == "REDIS_URL":
        _current.clear()
