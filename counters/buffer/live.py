"""Live counters: each change of a member published on its own channel, for its watchers.

A counter made live (``track(..., live=True)``) has each change of a member
announced on that member's shard channel, ``<prefix>:{sN}:live:<member>``
(the hash tag of the member's shard, so a Redis Cluster 7+ or Valkey routes
it with the shard's keys). Only the processes that watch the member subscribe
to it, and a publish nobody subscribed to costs Redis one dictionary lookup.
A message is empty: a watcher re-reads the exact value
(:mod:`counters.read.watch`), so a lost or late message makes a value late,
never wrong.

Two publishers:

- the push script itself, for the live members of a push: the start of the
  shard's channels (:func:`channel_base`) is one more key, to which the
  script appends each member; in a push of some live members and some not,
  their pairs come first and their number is one more argument
  (:func:`live_calls`). A push of one live member is encoded as fast as any
  (:meth:`Intake._live_entry <counters.buffer.intake.Intake._live_entry>`). A
  push with no live member is sent exactly as before, and the script does no
  more work for it;
- :func:`publish`, called after the COMMIT of a change that does not go
  through a push: a direct write when Redis is down, a discard of
  quarantined deltas.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from zlib import crc32

from redis.exceptions import RedisError, ResponseError

from counters.buffer.cluster import Client

logger = logging.getLogger(__name__)

#: Names of the live counters of this process (``track(..., live=True)``).
LIVE_COUNTERS: set[str] = set()


def make_live(name: str) -> None:
    """Publish the changes of counter ``name`` from now on."""
    LIVE_COUNTERS.add(name)


def is_live(member: str) -> bool:
    """Whether ``member`` (``"<counter>:<key>"``) belongs to a live counter."""
    return member.partition(":")[0] in LIVE_COUNTERS


def channel_base(prefix: str, shard: int) -> str:
    """The start of the channels of ``shard``'s live members: the member follows."""
    return f"{prefix}:{{s{shard}}}:live:"


def channel(prefix: str, shard: int, member: str) -> str:
    """The shard channel of ``member`` (in ``shard``), where its changes are announced."""
    return f"{prefix}:{{s{shard}}}:live:{member}"


def live_calls(
    prefix: str,
    groups: Mapping[int, Sequence[str | int]],
    calls: Sequence[tuple[Sequence[str], list]],
) -> list[tuple[Sequence[str], list]]:
    """The push script's calls (one per shard of ``groups``, in its order) with the start of
    the shard's channels as a fifth key where some members are live: all of them (the
    arguments as they are), or some (their pairs first, their number after the four fixed
    arguments). A call without a live member is returned as it is."""
    out: list[tuple[Sequence[str], list]] = []
    for (shard, args), (keys, call) in zip(groups.items(), calls, strict=True):
        mine: list[str | int] = []
        rest: list[str | int] = []
        for i in range(0, len(args), 2):
            (mine if is_live(str(args[i])) else rest).extend(args[i : i + 2])
        if not mine:
            out.append((keys, call))
        elif not rest:
            out.append(((*keys, channel_base(prefix, shard)), call))
        else:
            live_call = [*call[:4], len(mine) // 2, *mine, *rest]
            out.append(((*keys, channel_base(prefix, shard)), live_call))
    return out


def publish(client: Client, prefix: str, shards: int, members: Iterable[str]) -> None:
    """Announce a committed change of ``members`` (those of live counters) on their
    channels, in one round trip. Never raises: a watcher that misses it re-reads the value
    when its connection comes back, and a failure is logged."""
    by_shard: dict[int, list[str]] = defaultdict(list)
    for member in members:
        if is_live(member):
            by_shard[crc32(member.encode()) % shards].append(member)
    if not by_shard:
        return
    try:
        try:
            _send(client, by_shard, prefix, "spublish")
        except ResponseError:  # Redis before 7: no shard channels
            _send(client, by_shard, prefix, "publish")
    except RedisError as exc:
        count = sum(len(changed) for changed in by_shard.values())
        logger.warning("could not announce the changes of %s live members: %s", count, exc)


def _send(client: Client, by_shard: Mapping[int, list[str]], prefix: str, command: str) -> None:
    pipe = client.pipeline(transaction=False)
    for shard, changed in by_shard.items():
        for member in sorted(changed):
            getattr(pipe, command)(channel(prefix, shard, member), "")
    pipe.execute()
