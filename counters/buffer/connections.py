"""redis-py connection classes that tell a command that never left from one that may have.

Connecting, and the health-check PING that precedes a command, happen before
the command is written: their failures raise :class:`NotConnected`, which
means "not sent". The write path relies on that to tell a push that failed
for sure from one that may still arrive.
"""

from __future__ import annotations

from typing import Any

from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from counters.base.exceptions import NotConnected


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
