"""Redis Sentinel (``COUNTERS_REDIS_SENTINELS``): a client of the master the sentinels name.

The client is redis-py's ``Sentinel(...).master_for(service)``: a plain
``Redis`` whose pool asks the sentinels for the master's address at each new
connection, and drops its idle connections when the address changes. The
buffer uses it as it uses a single Redis; the conventions of
:mod:`counters.buffer.connections` hold:

- no retry by redis-py, neither for commands nor for the sentinels' own
  queries: a command that timed out may have run, and the write path falls
  back to the database at once instead (a sentinel that does not answer is
  skipped for the next one);
- finding no master (no sentinel answers, or the master is down and not yet
  replaced) is a failure to connect, :class:`~counters.base.exceptions.NotConnected`:
  nothing was sent;
- the socket timeouts of the buffer apply to the master and to the sentinels.

The URL (``COUNTERS_REDIS_URL``) gives what the master needs beside its
address: its scheme (``rediss://`` or ``valkeys://`` for TLS), user name,
password and database. Its host and port are not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis import Redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel

from counters.buffer.connections import (
    HEALTH_CHECK_INTERVAL,
    SentinelTcpConnection,
    SentinelTlsConnection,
    redis_scheme,
)

#: Port of a sentinel named without one.
DEFAULT_PORT = 26379

#: Options of the URL that name where a server is, not how to talk to it.
_ADDRESS_OPTIONS = ("host", "port", "path", "connection_class")


def sentinel_addresses(entries: Sequence[str]) -> list[tuple[str, int]]:
    """``[(host, port)]`` of ``entries`` (``"host:port"``, ``"host"`` for port 26379,
    ``"[::1]:26379"``). Raises ValueError naming the first entry that is not one."""
    addresses = []
    for entry in entries:
        text = entry.strip()
        host, port = _split(text)
        if not host or any(c in host for c in "/@ "):
            raise ValueError(f"{entry!r} is not a sentinel address (host:port)")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{entry!r} has no valid port (1-65535)")
        addresses.append((host, int(port)))
    if not addresses:
        raise ValueError("no sentinel is named")
    return addresses


def _split(text: str) -> tuple[str, str]:
    """(host, port text) of ``text``; the default port when it names none."""
    if text.startswith("["):  # an IPv6 address: [::1]:26379
        host, _, rest = text[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else (rest or str(DEFAULT_PORT))
    if text.count(":") > 1:
        return "", ""  # an IPv6 address needs its brackets
    host, sep, port = text.partition(":")
    return host, port if sep else str(DEFAULT_PORT)


def master_options(url: str) -> dict[str, Any]:
    """Connection options for the master from ``url``: credentials, database, TLS options.

    Raises ValueError for a URL redis-py cannot read, or a unix socket (the
    sentinels give a host and a port).
    """
    url = redis_scheme(url)
    if url.partition("://")[0] not in ("redis", "rediss"):
        raise ValueError(
            f"with Sentinel the URL needs a redis://, rediss://, valkey:// or valkeys:// "
            f"scheme, got {url.split('://')[0]!r}"
        )
    options = parse_url(url)
    return {k: v for k, v in options.items() if k not in _ADDRESS_OPTIONS}


def sentinel_master(entries: Sequence[str], service: str, url: str, timeout: float) -> Redis:
    """A client of the master of ``service``, as the sentinels at ``entries`` name it."""
    tls = redis_scheme(url).startswith("rediss://")
    no_retry = Retry(NoBackoff(), 0)
    sentinel = Sentinel(
        sentinel_addresses(entries),
        sentinel_kwargs={
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": no_retry,
        },
    )
    return sentinel.master_for(
        service,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=no_retry,
        health_check_interval=HEALTH_CHECK_INTERVAL,
        connection_class=SentinelTlsConnection if tls else SentinelTcpConnection,
        **master_options(url),
    )
