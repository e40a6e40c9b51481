"""Pipelines on a Redis Cluster: commands sent node by node, redirections followed.

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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis import Redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, MovedError, RedisClusterException, RedisError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from counters.base.exceptions import NotConnected

#: Rounds of one pipeline: the first, and resends of what the cluster redirected.
ATTEMPTS = 3
#: Commands whose keys follow a script (or its sha) and the number of keys.
SCRIPT_COMMANDS = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro"})


@dataclass
class RedisCommand:
    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)

    def key(self) -> Any:
        """The key that routes the command, or None for a keyless script."""
        if self.name in SCRIPT_COMMANDS:
            return self.args[2] if int(self.args[1]) > 0 else None
        return self.args[0] if self.args else None


class Router(Protocol):
    """What a pipeline needs of its cluster client
    (:class:`~counters.buffer.cluster.ClusterClient`): the cluster and its slot table, and
    the sending of queued commands."""

    def cluster(self) -> RedisCluster: ...

    def refresh(self) -> None: ...

    def send(self, commands: Sequence[RedisCommand], raise_on_error: bool = True) -> list[Any]: ...


@dataclass
class Round:
    """What one round of sending leaves to do."""

    #: Commands the cluster did not run, to send again (by index).
    retry: list[int] = field(default_factory=list)
    #: Commands never sent, with the name of the master they were for (None: no master).
    unreached: list[tuple[int, str | None]] = field(default_factory=list)
    #: The slot table may be out of date: refresh it before the next round.
    stale: bool = False
    #: A slot is being migrated (TRYAGAIN): pause before the next round.
    wait: bool = False


class Sending:
    """Commands sent to the masters of their slots in up to ``ATTEMPTS`` rounds.

    Each command's reply (or the error that stopped it) is kept by its index;
    a command is sent again only if the cluster did not run it.
    """

    def __init__(self, client: Router, commands: Sequence[RedisCommand]) -> None:
        self.client = client
        self.cluster = client.cluster()
        self.commands = commands
        self.replies: list[Any] = [None] * len(commands)
        #: Commands to send with ASKING to the node an ASK reply named.
        self.asking: dict[int, ClusterNode] = {}

    def run(self, raise_on_error: bool) -> list[Any]:
        """Send every command, one pipeline per master and round; replies in order."""
        todo = list(range(len(self.commands)))
        for attempt in range(1, ATTEMPTS + 1):
            round_ = Round()
            for node, indexes in self.route(todo, round_).values():
                self.send_to(node, indexes, round_)
            if round_.stale:
                self.client.refresh()
            round_.retry.extend(self.readdressed(round_.unreached))
            if not round_.retry or attempt == ATTEMPTS:
                break
            if round_.wait:
                time.sleep(0.05)
            todo = sorted(round_.retry)
        return outcome(self.replies, raise_on_error)

    def node(self, command: RedisCommand) -> ClusterNode:
        """The master of ``command``'s key (the default node for a keyless one)."""
        key = command.key()
        if key is None:
            return self.cluster.get_default_node()
        return self.cluster.get_node_from_key(key)

    def route(self, todo: list[int], round_: Round) -> dict[str, tuple[ClusterNode, list[int]]]:
        """Commands ``todo`` by the master to send them to (the node of an ASK first).

        A command whose slot no master serves now is unreached, and not sent.
        """
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i in todo:
            try:
                node = self.asking.get(i) or self.node(self.commands[i])
            except RedisClusterException as exc:  # a slot no master serves now
                self.replies[i] = NotConnected(str(exc))
                round_.unreached.append((i, None))
                round_.stale = True
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        return groups

    def send_to(self, node: ClusterNode, indexes: list[int], round_: Round) -> None:
        """Send commands ``indexes`` to ``node`` in one pipeline.

        If the pipeline never left, they are unreached; if it failed after it
        was sent, each keeps the error (it may have run) and is not sent again.
        """
        pipe = self.cluster.get_redis_connection(node).pipeline(transaction=False)
        for i in indexes:
            if i in self.asking:
                pipe.execute_command("ASKING")
            command = self.commands[i]
            getattr(pipe, command.name)(*command.args, **command.kwargs)
        try:
            results = pipe.execute(raise_on_error=False)
        except NotConnected as exc:  # nothing was sent to this node
            for i in indexes:
                self.replies[i] = exc
                round_.unreached.append((i, node.name))
            round_.stale = True
            return
        except RedisError as exc:  # sent: it may have run
            for i in indexes:
                self.replies[i] = exc
            round_.stale = True
            return
        self.keep(indexes, results, round_)

    def keep(self, indexes: list[int], results: list[Any], round_: Round) -> None:
        """Keep the replies of commands ``indexes``; those the cluster redirected go again.

        A ``MOVED`` reply points its slot at the named node; an ``ASK`` reply
        sends the command to the named node, after ``ASKING``; a ``TRYAGAIN``
        waits a little.
        """
        answers = iter(results)
        for i in indexes:
            if self.asking.pop(i, None) is not None:
                next(answers)  # the reply to ASKING
            reply = self.replies[i] = next(answers)
            if isinstance(reply, MovedError):
                self.moved(reply)
                round_.retry.append(i)
            elif isinstance(reply, AskError):
                target = self.cluster.get_node(host=reply.host, port=reply.port)
                if target is not None:
                    self.asking[i] = target
                else:
                    round_.stale = True
                round_.retry.append(i)
            elif isinstance(reply, TryAgainError):
                round_.wait = True
                round_.retry.append(i)

    def moved(self, reply: MovedError) -> None:
        """Point the slot of a MOVED reply at the node it names (a full refresh if that fails)."""
        try:
            self.cluster.nodes_manager.move_slot(reply)
        except Exception:
            self.client.refresh()

    def readdressed(self, unreached: list[tuple[int, str | None]]) -> list[int]:
        """The commands of ``unreached`` whose slot has another master now: never sent,
        they can be sent to it."""
        again = []
        for i, name in unreached:
            try:
                if self.node(self.commands[i]).name != name:
                    again.append(i)  # never sent, and the slot has a new master now
            except RedisClusterException:
                pass
        return again


def outcome(replies: list[Any], raise_on_error: bool) -> list[Any]:
    """``replies``, raised like a pipeline of one Redis: :class:`NotConnected` only if no
    command was sent; another connection error if some may have run; else, with
    ``raise_on_error``, the first error reply."""
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


class NodePipeline:
    """Commands queued like a redis-py pipeline (``pipe.get(key)``, ``pipe.evalsha(...)``),
    sent by :meth:`Router.send` as one pipeline per master.

    Each command goes to the master of its first key (of a script's first
    key): the keys of one command must share a slot.
    """

    def __init__(self, client: Router) -> None:
        self.client = client
        self.commands: list[RedisCommand] = []

    def __getattr__(self, name: str) -> Callable[..., NodePipeline]:
        if name.startswith("_") or not callable(getattr(Redis, name, None)):
            raise AttributeError(name)

        def queue(*args: Any, **kwargs: Any) -> NodePipeline:
            self.commands.append(RedisCommand(name, args, kwargs))
            return self

        return queue

    def __len__(self) -> int:
        return len(self.commands)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        commands, self.commands = self.commands, []
        if not commands:
            return []
        return self.client.send(commands, raise_on_error)
