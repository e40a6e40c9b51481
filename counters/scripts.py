"""Lua scripts of the drain path, which Redis must run even when it is full.

At ``maxmemory`` with ``noeviction``, Redis refuses every command that may
grow its memory: a lease ``SET NX``, a fence marker, a move of pending deltas
into a batch. Pushes should be refused then (writers fall back to the DB),
but the flush must still drain what is buffered, or Redis stays full forever.
Redis 7 runs a script whose first line is ``#!lua flags=allow-oom`` at any
memory use. A server that does not know script flags (Redis 6, fakeredis)
fails on that line; there the same script runs without it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

from redis.commands.core import Script
from redis.exceptions import ResponseError

from .cluster import Client

#: First line of a script Redis runs even at maxmemory (Redis 7 script flags).
ALLOW_OOM = "#!lua flags=allow-oom\n"

# Runs only where the server reads script flags: tells whether it does.
PROBE_SCRIPT = ALLOW_OOM + "return 1"

_lock = threading.Lock()
_flags: weakref.WeakKeyDictionary[Client, bool] = weakref.WeakKeyDictionary()


def flags_supported(client: Client) -> bool:
    """Whether ``client``'s server runs scripts with flags; asked once per client.

    Only a refusal of the probe script answers no: a connection error is
    raised, and the next call asks again.
    """
    known = _flags.get(client)
    if known is None:
        try:
            known = client.eval(PROBE_SCRIPT, 0) == 1
        except ResponseError as exc:
            if str(exc).startswith("BUSY"):  # another script is running: ask again later
                raise
            known = False
        with _lock:
            _flags[client] = known
    return known


class DrainScript:
    """A script the flush needs at maxmemory: flagged ``allow-oom`` where Redis supports it.

    Called like a redis-py ``Script`` (``script(keys=[...], args=[...])``).
    Which text to use is decided at the first call, so creating one never
    talks to Redis.
    """

    def __init__(self, client: Client, body: str) -> None:
        self.client = client
        self.body = body
        self._script: Script | None = None

    def resolve(self) -> Script:
        """The registered redis-py script (its ``sha`` and ``script`` text)."""
        if self._script is None:
            text = ALLOW_OOM + self.body if flags_supported(self.client) else self.body
            self._script = self.client.register_script(text)
        return self._script

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        return self.resolve()(keys=list(keys), args=list(args))
