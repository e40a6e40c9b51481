"""Redis Cluster (``COUNTERS_REDIS_CLUSTER``): the client, and pipelines sent node by node.

Every key of a shard carries the hash tag ``{sN}``, so a shard lives in one
slot and each Lua script runs whole on the master that holds it. Keys without
a tag (``<prefix>:rebuild``, ``:repair``, ``:last_flush``) are only used by
single-key commands.

Scripts and pipelines go node by node, one pipeline per master
(:mod:`counters.buffer.pipelines`): redis-py's ``RedisCluster`` refuses
EVALSHA in its pipelines, and loses the distinction the write path needs
between a command that never left and one that may have run.

Every other command is redis-py's own, with ``RedisCluster``'s retries off,
and its ``RedisClusterException`` (no ``RedisError``) raised as a
``ConnectionError``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

from redis import Redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import ConnectionPool, SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry
from redis.typing import ScriptTextT

from counters.base.exceptions import NotConnected
from counters.buffer.connections import (
    HEALTH_CHECK_INTERVAL,
    TcpConnection,
    TlsConnection,
    redis_scheme,
)
from counters.buffer.pipelines import NodePipeline, RedisCommand, Sending

logger = logging.getLogger(__name__)

#: The client of the buffer: one Redis, or a Redis Cluster.
Client: TypeAlias = "Redis | ClusterClient"


def node_urls(url: str) -> list[str]:
    """The node URLs in ``url``: one ``redis://`` or ``rediss://`` URL, or several, comma-separated
    (``valkey://`` and ``valkeys://`` are returned as ``redis://`` and ``rediss://``).

    Raises ValueError for a URL a cluster node cannot have.
    """
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise ValueError("COUNTERS_REDIS_URL names no Redis Cluster node")
    for node in urls:
        scheme = redis_scheme(node).partition("://")[0].lower()
        if scheme not in ("redis", "rediss"):
            raise ValueError(
                "a Redis Cluster node needs a redis:// or rediss:// URL (or valkey://, "
                f"valkeys://), got {node!r}"
            )
        if int(parse_url(redis_scheme(node)).get("db") or 0) != 0:
            raise ValueError(f"a Redis Cluster has database 0 only, got {node!r}")
    return [redis_scheme(node) for node in urls]


class NodePool(ConnectionPool):
    """Connection pool of one cluster node: connections that raise NotConnected, health checks.

    RedisCluster gives each node a pool of the URL's connection class (plain
    or TLS); this keeps the choice and makes it ours.
    """

    def __init__(self, connection_class: type = TcpConnection, **kwargs: Any) -> None:
        tls = issubclass(connection_class, SSLConnection)
        kwargs.setdefault("health_check_interval", HEALTH_CHECK_INTERVAL)
        super().__init__(connection_class=TlsConnection if tls else TcpConnection, **kwargs)


def _reraised(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of RedisCluster, sent once more if it never left (RedisCluster has
    refreshed its slot table by then: a failed-over slot has its new master), and with
    RedisClusterException raised as a ConnectionError."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            try:
                return method(*args, **kwargs)
            except NotConnected:
                return method(*args, **kwargs)
        except RedisClusterException as exc:
            raise RedisConnectionError(f"Redis Cluster: {exc}") from exc

    return call


class ClusterClient:
    """A redis-py ``RedisCluster`` made at first use; scripts and pipelines go node by node.

    Making a RedisCluster asks a node for the slot table, so it waits for
    the first command: a process starts, and its buffer exists, while the
    cluster is unreachable, and its commands raise :class:`NotConnected`
    until one of the URLs answers. After that every node the cluster
    reports is known, whichever URL answered.
    """

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        self.urls = node_urls(url)
        self._cluster: RedisCluster | None = None
        self._lock = threading.Lock()
        # How redis-py encodes a script into bytes (for its sha), without connecting.
        self._encoder = ConnectionPool().get_encoder()

    def cluster(self) -> RedisCluster:
        """The RedisCluster, made now if need be; NotConnected if no node answers."""
        cluster = self._cluster
        if cluster is None:
            with self._lock:
                cluster = self._cluster
                if cluster is None:
                    cluster = self._cluster = self._connect()
        return cluster

    def _connect(self) -> RedisCluster:
        first, *others = self.urls
        try:
            return RedisCluster(
                url=first,
                startup_nodes=[ClusterNode(**_host_port(url)) for url in others],
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
                # No retries: a command that timed out may have run, and sending it
                # again is the caller's decision (a push falls back to the DB instead).
                retry=Retry(NoBackoff(), 0),
                # Shards on the masters that are up keep working while a slot is not served.
                require_full_coverage=False,
                connection_pool_class=NodePool,
            )
        except (RedisClusterException, RedisError) as exc:
            raise NotConnected(
                f"no node of the Redis Cluster at {self.url} answered: {exc}"
            ) from exc

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        attribute = getattr(self.cluster(), name)
        if callable(attribute) and not isinstance(attribute, type):
            return _reraised(attribute)
        return attribute

    def get_encoder(self) -> Any:
        """The encoder redis-py's ``Script`` asks the client for (UTF-8)."""
        return self._encoder

    def register_script(self, script: ScriptTextT) -> Script:
        """A redis-py Script whose calls come back here (EVALSHA by node)."""
        return Script(cast(Redis, self), script)

    def pipeline(self, transaction: bool = False) -> NodePipeline:
        if transaction:
            raise ValueError("a Redis Cluster pipeline cannot be a transaction")
        return NodePipeline(self)

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        return self.pipeline().evalsha(sha, numkeys, *keys_and_args).execute()[0]

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any:
        return self.pipeline().eval(script, numkeys, *keys_and_args).execute()[0]

    def script_load(self, script: ScriptTextT) -> str:
        """Load ``script`` on every master that answers (a failed one loads it when it is back)."""
        cluster = self.cluster()
        sha, error = None, None
        for node in cluster.get_primaries():
            try:
                sha = cluster.get_redis_connection(node).script_load(script)
            except RedisError as exc:
                error = error or exc
        if sha is None:
            raise error or NotConnected(f"the Redis Cluster at {self.url} has no master")
        return sha

    def refresh(self) -> None:
        """Read the slot table again from a node that answers; never raises.

        Threads that fail at once refresh once: redis-py skips a refresh that
        another thread completed while this one waited for it.
        """
        try:
            self.cluster().nodes_manager.initialize()
        except Exception as exc:  # the next command tries again
            logger.debug("refreshing the Redis Cluster slot table failed: %s", exc)

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()

    def send(self, commands: Sequence[RedisCommand], raise_on_error: bool = True) -> list[Any]:
        """Run ``commands``, one pipeline per master; replies in order.

        Raises like a pipeline of one Redis: :class:`NotConnected` only if
        no command reached Redis; another connection error if some may have
        run; else, with ``raise_on_error``, the first error reply.
        """
        return Sending(self, commands).run(raise_on_error)


def _host_port(url: str) -> dict[str, Any]:
    options = parse_url(url)
    return {"host": options.get("host", "localhost"), "port": int(options.get("port", 6379))}
