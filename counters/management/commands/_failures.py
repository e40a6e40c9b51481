"""One readable line when a command fails; the traceback goes to the log at DEBUG.

A command run from cron or by an operator on a bad day must say what went
wrong in one line on stderr and exit non-zero, never dump a traceback. The
traceback is logged to the ``counters`` logger at DEBUG (shown with
``COUNTERS_LOG_LEVEL=DEBUG``) and by ``--traceback``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from counters.base import conf
from counters.base.exceptions import BufferUnavailable, CountersError
from counters.base.utils import first_line

logger = logging.getLogger(__name__)

#: Longest failure line a command prints.
LINE_LIMIT = 500


def describe(exc: BaseException) -> str:
    """One line that says what failed: Redis, the database, or what else."""
    line = first_line(exc)
    if isinstance(exc, CountersError):
        text = line
    elif isinstance(exc, DatabaseError):
        text = f"database error: {line}"
    elif isinstance(exc, RedisError):
        text = first_line(BufferUnavailable(conf.redis_where(), exc))
    else:
        text = f"{type(exc).__name__}: {line}"
    return text[:LINE_LIMIT]


def redis_unreachable(exc: BaseException) -> bool:
    """Redis could not be reached at all (not: it answered with an error reply)."""
    if isinstance(exc, BufferUnavailable):
        return not exc.reachable
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError))


def redis_state(exc: BaseException) -> str | None:
    """``"unreachable"``, ``"error reply"`` or None: Redis's part in failure ``exc``."""
    cause = exc.cause if isinstance(exc, BufferUnavailable) else exc
    if redis_unreachable(exc):
        return "unreachable"
    if isinstance(cause, ResponseError):
        return "error reply"
    return None


def failure_data(exc: BaseException) -> dict[str, Any]:
    """The JSON object a command prints with ``--json`` when it fails: ``error``, ``redis``."""
    data: dict[str, Any] = {"error": describe(exc)}
    state = redis_state(exc)
    if state is not None:
        data["redis"] = state
    return data


def failure(command: str, exc: BaseException) -> CommandError:
    """The CommandError to raise for ``exc``, after logging its traceback at DEBUG."""
    logger.debug("%s failed", command, exc_info=exc)
    return CommandError(describe(exc))


class OneLineFailures(BaseCommand):
    """A command whose every failure ends in one line on stderr and exit status 1."""

    def execute(self, *args: Any, **options: Any) -> Any:
        try:
            return super().execute(*args, **options)
        except CommandError:
            raise
        except Exception as exc:
            raise failure(self.__module__.rpartition(".")[2], exc) from exc
