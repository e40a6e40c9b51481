"""The Lua scripts of the buffer: one file each in ``lua/``, and the drain path's flag.

Each script is a file ``lua/<name>.lua`` whose header names its KEYS and
ARGV, read once by :func:`load` into a constant here. The buffer registers
them with redis-py, which sends EVALSHA and loads a script on NOSCRIPT.

At ``maxmemory`` with ``noeviction``, Redis refuses every command that may
grow its memory: a lease ``SET NX``, a fence marker, a move of pending deltas
into a batch. Pushes should be refused then (writers fall back to the DB),
but the flush must still drain what is buffered, or Redis stays full forever.
Redis 7 runs a script whose first line is ``#!lua flags=allow-oom`` at any
memory use: the drain path's files start with that line. A server that does
not know script flags (Redis 6, fakeredis) fails on it; there a
:class:`DrainScript` runs the same script without it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis.commands.core import Script
from redis.exceptions import ResponseError

from counters.buffer.cluster import Client

#: First line of a script Redis runs even at maxmemory (Redis 7 script flags).
ALLOW_OOM = "#!lua flags=allow-oom\n"


@functools.cache
def load(name: str) -> str:
    """The text of the script ``lua/<name>.lua`` of this package, read once."""
    return (resources.files("counters.buffer") / "lua" / f"{name}.lua").read_text("utf-8")


# Add deltas to a shard's pending set as one push of a writer, at most once and in order.
PUSH_SCRIPT = load("push")
# Fence the last push of a retired writer: whether it applied, else it never will (drain).
FENCE_SCRIPT = load("fence")
# Forget an acknowledged batch, then return the batch in flight or move a new one (drain).
MOVE_SCRIPT = load("move")
# Forget the batch in flight if it is still the one named (drain).
ACK_SCRIPT = load("ack")
# Send members of the batch in flight back to pending; the rest stays under a new id (drain).
NARROW_SCRIPT = load("narrow")
# Hold every delta of the batch in flight in the shard's quarantine; forget the batch (drain).
QUARANTINE_SCRIPT = load("quarantine")
# Put quarantined deltas back into pending, each at most once.
REQUEUE_SCRIPT = load("requeue")
# Drop quarantined deltas for good (drain).
DISCARD_SCRIPT = load("discard")
# Quarantine deltas that never entered Redis, each field once (drain).
SET_ASIDE_SCRIPT = load("set_aside")
# Snapshot of a shard for reads: buffered sums of members, high-water marks of writers.
READ_SCRIPT = load("read")
# Take a lease unless it is held (drain).
ACQUIRE_SCRIPT = load("acquire")
# Push back the expiry of a lease that still holds our token (drain).
EXTEND_SCRIPT = load("extend")
# Delete a lease that still holds our token (drain).
RELEASE_SCRIPT = load("release")
# Runs only where the server reads script flags: tells whether it does.
PROBE_SCRIPT = load("probe")
# Give a shard its epoch token unless it has one (drain).
EPOCH_TOKEN_SCRIPT = load("epoch_token")
# Raise a shard's batch sequence to at least a floor (drain).
SEQ_FLOOR_SCRIPT = load("seq_floor")

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

    ``text`` is the script with or without its ``#!lua flags=allow-oom``
    line; the server is sent it with that line where it reads flags, else
    without. Called like a redis-py ``Script`` (``script(keys=[...],
    args=[...])``). Which text to use is decided at the first call, so
    creating one never talks to Redis.
    """

    def __init__(self, client: Client, text: str) -> None:
        self.client = client
        self.body = text.removeprefix(ALLOW_OOM)
        self._script: Script | None = None

    def resolve(self) -> Script:
        """The registered redis-py script (its ``sha`` and ``script`` text)."""
        if self._script is None:
            text = ALLOW_OOM + self.body if flags_supported(self.client) else self.body
            self._script = self.client.register_script(text)
        return self._script

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        return self.resolve()(keys=list(keys), args=list(args))
