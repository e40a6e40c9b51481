"""Exceptions raised by the counters app. Each carries the data it is about."""

from __future__ import annotations

from django.core.exceptions import AppRegistryNotReady, ImproperlyConfigured
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


def _capped(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CountersError(Exception):
    """Base class of every error the counters app raises on purpose."""


class UnknownCounter(CountersError, LookupError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no counter named {name!r} is registered")


class NotLive(CountersError, ValueError):
    """``awatch`` of a counter not declared with ``track(..., live=True)``."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"counter {name!r} is not live: declare it with track(..., live=True)")


class InvalidKey(CountersError, ValueError):
    """``key`` is no valid key of counter ``counter``; ``reason`` says why.

    Raised by ``add()`` before anything is buffered, so a delta that could
    never be applied never reaches Redis.
    """

    def __init__(self, counter: str, key: object, reason: str) -> None:
        self.counter = counter
        self.key = key
        self.reason = reason
        super().__init__(
            f"invalid key {_capped(repr(key))} for counter {counter!r}: {_capped(reason)}"
        )


def redis_failure(url: str, cause: BaseException) -> str:
    """What went wrong with Redis at ``url``, named by kind: unreachable, or an error reply.

    A connection refused or a timeout is "unreachable"; an error reply
    (``WRONGTYPE``, ``OOM``, ``READONLY``, ``NOSCRIPT`` ...) means Redis
    answered, and says so; anything else is a "Redis error".
    """
    if isinstance(cause, (RedisConnectionError, RedisTimeoutError)):
        return f"Redis unreachable at {url}: {cause}"
    if isinstance(cause, ResponseError):
        return f"Redis at {url} answered with an error reply: {cause}"
    return f"Redis error at {url}: {type(cause).__name__}: {cause}"


class BufferUnavailable(CountersError):
    """Redis could not be used: unreachable, or it answered with an error (``cause``).

    ``url`` says where it was looked for; ``reachable`` is False when it could
    not be reached at all (a connection refused, a timeout).
    """

    def __init__(self, url: str, cause: BaseException) -> None:
        self.url = url
        self.cause = cause
        self.reachable = not isinstance(cause, (RedisConnectionError, RedisTimeoutError))
        super().__init__(redis_failure(url, cause))


class NotConnected(RedisConnectionError):
    """No connection to Redis could be made, so nothing of the command was sent.

    Raised instead of redis-py's ``ConnectionError``/``TimeoutError`` when
    connecting (or the health-check PING before a command) failed. Any other
    Redis error may come after the command left: it may still apply.
    """


class InconsistentRead(CountersError):
    """No reading of ``counter`` could be proven consistent: batches of ``shards``
    kept moving while it was read, and their leases stayed busy."""

    def __init__(self, counter: str, shards: list[int]) -> None:
        self.counter = counter
        self.shards = shards
        super().__init__(
            f"could not read {counter!r} consistently: shards {shards} kept flushing; try again"
        )


class StalePush(CountersError):
    """Redis refused a push that reached it too late (clocks apart, or a stalled client)."""

    def __init__(self, push_id: str) -> None:
        self.push_id = push_id
        super().__init__(
            f"push {push_id} reached Redis too late and was refused; "
            "check that the clocks of the app servers and Redis agree"
        )


class ScoreLimitExceeded(CountersError):
    """A push refused members whose pending sum would reach 2**53 in magnitude.

    A Redis score is a double, exact for integers below 2**53 only. The
    ``members`` ({member: delta}) were not added; ``shards`` were changed by
    the call. Pushing the other members again with the same ``push_id``
    completes the push.
    """

    def __init__(self, push_id: str, members: dict[str, int], shards: set[int]) -> None:
        self.push_id = push_id
        self.members = members
        self.shards = shards
        super().__init__(
            f"push {push_id}: {len(members)} deltas would leave the exact range of a Redis score"
        )


class UnexpectedScriptReply(CountersError):
    """A Lua script answered something its caller does not know."""

    def __init__(self, script: str, reply: object) -> None:
        self.script = script
        self.reply = reply
        super().__init__(f"{script} returned unexpected {reply!r}")


class RedisTooOld(CountersError):
    """The buffer's Redis lacks a command the flush runs (``ZRANGESTORE``: Redis 6.2+)."""

    def __init__(self, command: str, version: str = "6.2") -> None:
        self.command = command
        super().__init__(
            f"the buffer's Redis does not know {command}: Tally needs Redis {version} or later"
        )


class FlushFailed(CountersError):
    """Some shards could not be flushed; ``result`` tells what the others did.

    ``errors`` maps each failed shard to the first line of its error. Their
    batches stay in flight and the next flush retries them.
    """

    def __init__(self, result: object, errors: dict[int, str]) -> None:
        self.result = result
        self.errors = errors
        shard, message = next(iter(sorted(errors.items())))
        super().__init__(f"flush failed in {len(errors)} shard(s); shard {shard}: {message}")


class RebuildRunning(CountersError):
    """A full rebuild, a repair or an audit of the same key prefix holds ``lease_key``."""

    def __init__(self, lease_key: str) -> None:
        self.lease_key = lease_key
        super().__init__(
            f"another rebuild or audit is running (it holds {lease_key}); try again later"
        )


class RepairFenced(CountersError):
    """A repair was refused: a newer repairer of ``prefix`` took the fence since ``token``.

    The repairer lost its lease (it stalled, or ran past it) and another one
    took over; its repair changed nothing, and it must stop.
    """

    def __init__(self, prefix: str, token: int) -> None:
        self.prefix = prefix
        self.token = token
        super().__init__(
            f"repair refused: a newer repairer of prefix {prefix!r} took over since fencing "
            f"token {token} (this one lost its lease); nothing was changed"
        )


class TrackingError(CountersError, ImproperlyConfigured):
    """``counters.track()`` refused counter ``counter``: ``problem``, system check ``check_id``."""

    def __init__(self, check_id: str, counter: str, problem: str) -> None:
        self.check_id = check_id
        self.counter = counter
        self.problem = problem
        super().__init__(f"{check_id}: counter {counter!r}: {problem}")


class TrackedTooEarly(CountersError, AppRegistryNotReady):
    """``counters.track()`` of counter ``counter`` ran before Django's models were loaded:
    at import time, e.g. at module level in a ``models.py``."""

    def __init__(self, counter: str) -> None:
        self.counter = counter
        super().__init__(
            f"counters.track({counter!r}) was called before Django's app registry is ready "
            "(at import time, e.g. at module level in models.py): call it from your app's "
            "AppConfig.ready()"
        )


class LayoutChangePending(CountersError):
    """Deltas of another buffer layout (key prefix, shard count, cluster) are not drained:
    reads miss them, so a repair now would count them twice once they are applied."""

    def __init__(self, layouts: list[str]) -> None:
        self.layouts = layouts
        super().__init__(
            "the buffer layout changed and these layouts are not drained yet: "
            f"{'; '.join(layouts)}; repairs wait until a flush has drained them "
            "(see counters_status)"
        )
