"""Redis Cluster (``COUNTERS_REDIS_CLUSTER``): the client, and pipelines sent node by node.

Every key of a shard carries the hash tag ``{sN}``, so a shard lives in one
slot and each Lua script runs whole on the master that holds it. Keys without
a tag (``<prefix>:rebuild``, ``:repair``, ``:last_flush``) are only used by
single-key commands.

redis-py's ``RedisCluster`` refuses EVALSHA in its pipelines, and its error
handling loses the distinction the write path needs (a command that never
left raises :class:`NotConnected`). So scripts and pipelines are sent here:
the commands are grouped by the master of their key's slot, and each group
goes in one pipeline to that master's own client, whose connections raise
``NotConnected`` when connecting fails. A command the cluster did not run (a
``MOVED``, ``ASK`` or ``TRYAGAIN`` reply, or a master that could not be
reached while a newer slot table names another one) is sent again, once the
slot table has been refreshed. A command that may have run is never sent
again here: the caller decides (every script of the buffer is safe to repeat).

Every other command is redis-py's own, with ``RedisCluster``'s retries off,
and its ``RedisClusterException`` (no ``RedisError``) raised as a
``ConnectionError``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, cast

from redis import Redis
from redis._parsers import Encoder
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import ConnectionPool, SSLConnection, parse_url
from redis.exceptions import AskError, MovedError, RedisClusterException, RedisError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.typing import ScriptTextT

from .connections import TcpConnection, TlsConnection
from .exceptions import NotConnected

logger = logging.getLogger(__name__)

#: Rounds of one pipeline: the first, and resends of what the cluster redirected.
ATTEMPTS = 3
#: Seconds a pooled connection may sit idle before a PING checks it, before the command.
HEALTH_CHECK_INTERVAL = 30
#: Commands whose keys follow a script (or its sha) and the number of keys.
SCRIPT_COMMANDS = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro"})

#: The client of the buffer: one Redis, or a Redis Cluster.
Client: TypeAlias = "Redis | ClusterClient"


def node_urls(url: str) -> list[str]:
    """The node URLs in ``url``: one ``redis://`` or ``rediss://`` URL, or several, comma-separated.

    Raises ValueError for a URL a cluster node cannot have.
    """
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise ValueError("COUNTERS_REDIS_URL names no Redis Cluster node")
    for node in urls:
        scheme = node.partition("://")[0].lower()
        if scheme not in ("redis", "rediss"):
            raise ValueError(
                f"a Redis Cluster node needs a redis:// or rediss:// URL, got {node!r}"
            )
        if int(parse_url(node).get("db") or 0) != 0:
            raise ValueError(f"a Redis Cluster has database 0 only, got {node!r}")
    return urls


class NodePool(ConnectionPool):
    """Connection pool of one cluster node: connections that raise NotConnected, health checks.

    RedisCluster gives each node a pool of the URL's connection class (plain
    or TLS); this keeps the choice and makes it ours.
    """

    def __init__(self, connection_class: type = TcpConnection, **kwargs: Any) -> None:
        tls = issubclass(connection_class, SSLConnection)
        kwargs.setdefault("health_check_interval", HEALTH_CHECK_INTERVAL)
        super().__init__(connection_class=TlsConnection if tls else TcpConnection, **kwargs)


@dataclass
class _Command:
    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)

    def key(self) -> Any:
        """The key that routes the command, or None for a keyless script."""
        if self.name in SCRIPT_COMMANDS:
            return self.args[2] if int(self.args[1]) > 0 else None
        return self.args[0] if self.args else None


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
        self._encoder = Encoder("utf-8", "strict", False)

    # -- the redis-py client ------------------------------------------------
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

    def get_encoder(self) -> Encoder:
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

    def _moved(self, cluster: RedisCluster, reply: MovedError) -> None:
        """Point the slot of a MOVED reply at the node it names (a full refresh if that fails)."""
        try:
            cluster.nodes_manager.move_slot(reply)
        except Exception:
            self.refresh()

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()

    # -- commands by node -----------------------------------------------------
    def _node(self, cluster: RedisCluster, command: _Command) -> ClusterNode:
        key = command.key()
        if key is None:
            return cluster.get_default_node()
        return cluster.get_node_from_key(key)

    def send(self, commands: Sequence[_Command], raise_on_error: bool = True) -> list[Any]:
        """Run ``commands``, one pipeline per master; replies in order.

        Raises like a pipeline of one Redis: :class:`NotConnected` only if
        no command reached Redis; another connection error if some may have
        run; else, with ``raise_on_error``, the first error reply.
        """
        cluster = self.cluster()
        replies: list[Any] = [None] * len(commands)
        asking: dict[int, ClusterNode] = {}
        todo = list(range(len(commands)))
        for attempt in range(1, ATTEMPTS + 1):
            groups: dict[str, tuple[ClusterNode, list[int]]] = {}
            unreached: list[tuple[int, str | None]] = []
            stale = wait = False
            for i in todo:
                try:
                    node = asking.get(i) or self._node(cluster, commands[i])
                except RedisClusterException as exc:  # a slot no master serves now
                    replies[i] = NotConnected(str(exc))
                    unreached.append((i, None))
                    stale = True
                    continue
                groups.setdefault(node.name, (node, []))[1].append(i)
            retry: list[int] = []
            for node, indexes in groups.values():
                pipe = cluster.get_redis_connection(node).pipeline(transaction=False)
                for i in indexes:
                    if i in asking:
                        pipe.execute_command("ASKING")
                    command = commands[i]
                    getattr(pipe, command.name)(*command.args, **command.kwargs)
                try:
                    results = pipe.execute(raise_on_error=False)
                except NotConnected as exc:  # nothing was sent to this node
                    for i in indexes:
                        replies[i] = exc
                        unreached.append((i, node.name))
                    stale = True
                    continue
                except RedisError as exc:  # sent: it may have run
                    for i in indexes:
                        replies[i] = exc
                    stale = True
                    continue
                answers = iter(results)
                for i in indexes:
                    if asking.pop(i, None) is not None:
                        next(answers)  # the reply to ASKING
                    reply = replies[i] = next(answers)
                    if isinstance(reply, MovedError):
                        self._moved(cluster, reply)
                        retry.append(i)
                    elif isinstance(reply, AskError):
                        target = cluster.get_node(host=reply.host, port=reply.port)
                        if target is not None:
                            asking[i] = target
                        else:
                            stale = True
                        retry.append(i)
                    elif isinstance(reply, TryAgainError):
                        wait = True
                        retry.append(i)
            if stale:
                self.refresh()
            for i, name in unreached:
                try:
                    if self._node(cluster, commands[i]).name != name:
                        retry.append(i)  # never sent, and the slot has a new master now
                except RedisClusterException:
                    pass
            if not retry or attempt == ATTEMPTS:
                break
            if wait:
                time.sleep(0.05)
            todo = sorted(retry)
        return _outcome(replies, raise_on_error)


def _outcome(replies: list[Any], raise_on_error: bool) -> list[Any]:
    failed = [r for r in replies if isinstance(r, (RedisConnectionError, RedisTimeoutError))]
    if failed:
        if len(failed) == len(replies) and all(isinstance(r, NotConnected) for r in failed):
            raise failed[0]
        sent = next((r for r in failed if not isinstance(r, NotConnected)), None)
        if sent is not None:
            raise sent
        raise RedisConnectionError(
            f"{len(failed)} of {len(replies)} commands could not reach their node "
            f"and the others were sent: {failed[0]}"
        ) from failed[0]
    if raise_on_error:
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is not None:
            raise error
    return replies


def _host_port(url: str) -> dict[str, Any]:
    options = parse_url(url)
    return {"host": options.get("host", "localhost"), "port": int(options.get("port", 6379))}


class NodePipeline:
    """Commands queued like a redis-py pipeline (``pipe.get(key)``, ``pipe.evalsha(...)``),
    sent by :meth:`ClusterClient.send` as one pipeline per master.

    Each command goes to the master of its first key (of a script's first
    key): the keys of one command must share a slot.
    """

    def __init__(self, client: ClusterClient) -> None:
        self.client = client
        self.commands: list[_Command] = []

    def __getattr__(self, name: str) -> Callable[..., NodePipeline]:
        if name.startswith("_") or not callable(getattr(Redis, name, None)):
            raise AttributeError(name)

        def queue(*args: Any, **kwargs: Any) -> NodePipeline:
            self.commands.append(_Command(name, args, kwargs))
            return self

        return queue

    def __len__(self) -> int:
        return len(self.commands)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        commands, self.commands = self.commands, []
        if not commands:
            return []
        return self.client.send(commands, raise_on_error)
