"""Counters that cannot be negative: reads show 0, and the next flush repairs the key.

A counter registered with ``non_negative=True`` (an unread count) is never
shown below zero. A negative reading means the counter drifted (a lost
increment, then the decrement) or that a decrement reached Redis before the
increment it follows. The reader gets 0, a WARNING is logged once per key per
process, and the member goes into the Redis set ``<prefix>:repair``. The next
flush rebuilds the queued keys of counters that have a truth source
(:func:`counters.verify.rebuild.repair_queued`); a
rebuild repairs only a difference seen twice, so a momentary negative costs
nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from redis import RedisError

from counters.base.registry import CounterSpec, get_spec
from counters.buffer.store import Buffer

logger = logging.getLogger(__name__)

#: Keys remembered per process as already warned about; the memory is reset when full.
WARNED_LIMIT = 10_000

_warned: set[str] = set()
_warned_lock = threading.Lock()


def queue_key(buffer: Buffer) -> str:
    return f"{buffer.prefix}:repair"


def clamp(
    spec: CounterSpec, values: dict[Any, int], buffer: Callable[[], Buffer]
) -> dict[Any, int]:
    """``values`` with negatives of a ``non_negative`` counter raised to 0 and queued for repair."""
    if not spec.non_negative:
        return values
    negative = {key: value for key, value in values.items() if value < 0}
    if not negative:
        return values
    members = {key: spec.member(key) for key in negative}
    with _warned_lock:
        new = [key for key, member in members.items() if member not in _warned]
        if len(_warned) + len(new) > WARNED_LIMIT:
            _warned.clear()
        _warned.update(members[key] for key in new)
    for key in new[:10]:
        logger.warning(
            "counter %s at %s reads %s, below zero: showing 0 and queueing it for repair",
            spec.name,
            str(key)[:100],
            negative[key],
        )
    if len(new) > 10:
        logger.warning("... and %s more keys of %s below zero", len(new) - 10, spec.name)
    try:
        buf = buffer()
        buf.client.sadd(queue_key(buf), *members.values())
    except RedisError as exc:
        logger.warning("could not queue %s keys of %s for repair: %s", len(members), spec.name, exc)
    return {key: max(0, value) for key, value in values.items()}


def queue(buffer: Buffer, name: str, keys: list[Any]) -> None:
    """Queue ``keys`` of counter ``name`` for the next flush to rebuild."""
    if keys:
        spec = get_spec(name)
        buffer.client.sadd(queue_key(buffer), *(spec.member(k) for k in keys))
