"""redis-py connection classes that tell a command that never left from one that may have.

Connecting, and the health-check PING that precedes a command, happen before
the command is written: their failures raise :class:`NotConnected`, which
means "not sent". The write path relies on that to tell a push that failed
for sure from one that may still arrive.

Valkey speaks the same protocol: ``valkey://`` and ``valkeys://`` URLs are
read as ``redis://`` and ``rediss://`` (:func:`redis_scheme`), which redis-py
refuses otherwise.
"""

from __future__ import annotations

from typing import Any

from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

from counters.base.exceptions import NotConnected

#: Seconds a pooled connection may sit idle before a PING checks it, before the command.
HEALTH_CHECK_INTERVAL = 30


class _TellsNotSent:
    """A connection that raises :class:`NotConnected` when a command never left."""

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


class _SentinelTellsNotSent(_TellsNotSent):
    """A connection to the master that Sentinel names: finding the master is connecting too.

    redis-py asks the sentinels for the master's address before it connects;
    no sentinel answering, or none knowing a master that is up (during a
    failover), raises before any command left: :class:`NotConnected`.
    """

    def connect(self) -> None:
        try:
            super().connect()  # type: ignore[misc]
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if isinstance(exc, NotConnected):
                raise
            raise NotConnected(str(exc)) from exc


class TcpConnection(_TellsNotSent, Connection):
    pass


class TlsConnection(_TellsNotSent, SSLConnection):
    pass


class UnixConnection(_TellsNotSent, UnixDomainSocketConnection):
    pass


class SentinelTcpConnection(_SentinelTellsNotSent, SentinelManagedConnection):
    pass


class SentinelTlsConnection(_SentinelTellsNotSent, SentinelManagedSSLConnection):
    pass


#: URL schemes read as another: Valkey's own names for a plain and a TLS connection.
SCHEME_ALIASES = {"valkey": "redis", "valkeys": "rediss"}


def redis_scheme(url: str) -> str:
    """``url`` with a ``valkey://`` or ``valkeys://`` scheme written ``redis://`` or
    ``rediss://``, as redis-py reads them; any other URL as it is."""
    scheme, sep, rest = url.partition("://")
    alias = SCHEME_ALIASES.get(scheme)
    return f"{alias}{sep}{rest}" if sep and alias else url


def connection_class(url: str) -> type[Connection] | type[UnixDomainSocketConnection]:
    """The connection class for ``url``'s scheme (``redis``, ``rediss``, ``valkey``,
    ``valkeys`` or ``unix``)."""
    scheme = redis_scheme(url).partition("://")[0].lower()
    if scheme == "unix":
        return UnixConnection
    return TlsConnection if scheme == "rediss" else TcpConnection
