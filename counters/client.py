"""Settings → Redis client and Buffer, cached per process; database aliases to flush."""

from __future__ import annotations

import threading
from typing import Any

from django.core.signals import setting_changed
from django.db import DEFAULT_DB_ALIAS, connections, router
from django.dispatch import receiver
from redis import Redis
from redis.backoff import NoBackoff
from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from . import conf
from .buffer import Buffer
from .exceptions import NotConnected

_lock = threading.Lock()
_clients: dict[tuple[str, float], Redis] = {}
_buffers: dict[tuple[str, float, str, int], Buffer] = {}
_current: dict[str, Buffer] = {}


class _TellsNotSent:
    """A connection that raises :class:`NotConnected` when a command never left.

    Connecting, and the health-check PING that precedes a command, happen
    before the command is written: their failures mean "not sent". The write
    path relies on that to tell a push that failed for sure from one that
    may still arrive.
    """

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if isinstance(exc, NotConnected):
                raise
            raise NotConnected(str(exc)) from exc

    def check_health(self) -> None:
        try:
            super().check_health()  # type: ignore[misc]
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if isinstance(exc, NotConnected):
                raise
            raise NotConnected(f"health check failed: {exc}") from exc


class TcpConnection(_TellsNotSent, Connection):
    pass


class TlsConnection(_TellsNotSent, SSLConnection):
    pass


class UnixConnection(_TellsNotSent, UnixDomainSocketConnection):
    pass


def connection_class(url: str) -> type[Connection] | type[UnixDomainSocketConnection]:
    """The connection class for ``url``'s scheme (``redis``, ``rediss`` or ``unix``)."""
    scheme = url.partition("://")[0].lower()
    if scheme == "unix":
        return UnixConnection
    return TlsConnection if scheme == "rediss" else TcpConnection


def get_client(url: str | None = None, timeout: float | None = None) -> Redis:
    """A shared client for ``url`` (default: ``COUNTERS_REDIS_URL``).

    redis-py's own retries are off: every caller here decides itself whether a
    repeat is safe, and the write path must fall back quickly when Redis is down.
    """
    url = url or conf.redis_url()
    timeout = conf.socket_timeout() if timeout is None else timeout
    key = (url, timeout)
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                client = _clients[key] = Redis.from_url(
                    url,
                    socket_timeout=timeout,
                    socket_connect_timeout=timeout,
                    retry=Retry(NoBackoff(), 0),
                    health_check_interval=30,
                    connection_class=connection_class(url),
                )
    return client


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
    url, timeout = conf.redis_url(), conf.socket_timeout()
    prefix, shards = buffer_prefix(using), conf.shards()
    key = (url, timeout, prefix, shards)
    buffer = _buffers.get(key)
    if buffer is None:
        buffer = _buffers[key] = Buffer(get_client(url, timeout), prefix, shards)
    _current[using] = buffer
    return buffer


def buffer_prefix(using: str = DEFAULT_DB_ALIAS) -> str:
    """Key prefix of the buffer of database ``using`` (the default's is the bare prefix)."""
    prefix = conf.key_prefix()
    return prefix if using == DEFAULT_DB_ALIAS else f"{prefix}.{using}"


def databases() -> list[str]:
    """Aliases that a flush without an alias drains (``COUNTERS_DATABASES``).

    Default: every database the routers let the counters app migrate to.
    """
    configured = conf.databases()
    if configured is not None:
        return configured
    return [alias for alias in connections if router.allow_migrate(alias, "counters")]


@receiver(setting_changed)
def _forget_buffer(setting: str, **kwargs: Any) -> None:
    if setting.startswith("COUNTERS_") or setting == "REDIS_URL":
        _current.clear()
