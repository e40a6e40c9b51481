"""Settings → Redis client and Buffer, cached per process; database aliases to flush."""

from __future__ import annotations

import threading
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
    TcpConnection,
    TlsConnection,
    UnixConnection,
    connection_class,
)
from counters.buffer.store import Buffer

_lock = threading.Lock()
_clients: dict[tuple[str, float, bool], Redis | ClusterClient] = {}
_buffers: dict[tuple[str, float, bool, str, int], Buffer] = {}
_current: dict[str, Buffer] = {}

__all__ = [
    "ClusterClient",
    "TcpConnection",
    "TlsConnection",
    "UnixConnection",
    "buffer_prefix",
    "connection_class",
    "flushed_databases",
    "get_buffer",
    "get_client",
]


def get_client(
    url: str | None = None, timeout: float | None = None, cluster: bool | None = None
) -> Redis | ClusterClient:
    """A shared client for ``url`` (default: ``COUNTERS_REDIS_URL``).

    With ``cluster`` (default: ``COUNTERS_REDIS_CLUSTER``) the URL names nodes
    of a Redis Cluster, one or several comma-separated, and the client is a
    :class:`~counters.buffer.cluster.ClusterClient`.

    redis-py's own retries are off: every caller here decides itself whether a
    repeat is safe, and the write path must fall back quickly when Redis is down.
    """
    url = url or conf.redis_url()
    timeout = conf.socket_timeout() if timeout is None else timeout
    cluster = conf.redis_cluster() if cluster is None else cluster
    key = (url, timeout, cluster)
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                client = _clients[key] = _make_client(url, timeout, cluster)
    return client


def _make_client(url: str, timeout: float, cluster: bool) -> Redis | ClusterClient:
    if cluster:
        return ClusterClient(url, timeout)
    return Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=30,
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
    url, timeout, cluster = conf.redis_url(), conf.socket_timeout(), conf.redis_cluster()
    prefix, shards = buffer_prefix(using), conf.shards()
    key = (url, timeout, cluster, prefix, shards)
    buffer = _buffers.get(key)
    if buffer is None:
        buffer = _buffers[key] = Buffer(get_client(url, timeout, cluster), prefix, shards)
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
