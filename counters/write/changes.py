"""The ``applied`` signal: what a committed transaction changed in stored counter rows.

Sent after the COMMIT of every transaction that applied deltas to counter
rows (a flush's batch, a direct write when Redis is down), once per counter,
with keyword arguments ``counter`` (its name), ``deltas`` (``{key: delta}``,
keys typed as the counter's key values, nonzero deltas only) and ``using``
(the database alias). The sender is the counter's model. Never sent for a
transaction that rolls back. Receivers are called with ``send_robust()``: one
that raises is logged (by Django, logger ``django.dispatch``) and changes
nothing for the flush. Public as ``counters.signals.applied``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any

from django.db import connections, transaction
from django.dispatch import Signal

from counters.base.registry import get_spec
from counters.buffer import live
from counters.client import get_buffer

logger = logging.getLogger(__name__)

#: Sent after COMMIT, once per counter: ``counter``, ``deltas`` ({key: delta}), ``using``.
applied = Signal()

#: {counter name: {key: delta}}: what one transaction changed in counter rows.
Changes = dict[str, dict[Any, int]]


def merge(into: Changes, more: Mapping[str, Mapping[Any, int]]) -> Changes:
    """Add ``more`` to ``into`` (in place, returned); keys whose sum is 0 are dropped."""
    for name, keyed in more.items():
        mine = into.setdefault(name, {})
        for key, delta in keyed.items():
            total = mine.get(key, 0) + delta
            if total:
                mine[key] = total
            else:
                mine.pop(key, None)
        if not mine:
            del into[name]
    return into


def announce(changes: Mapping[str, Mapping[Any, int]], using: str) -> None:
    """Send :data:`applied` for ``changes`` once the current transaction commits.

    Call right after the transaction that applied them: outside any
    ``atomic()`` block (committed already) they are sent now; inside an
    outer one, on its COMMIT, and never if it rolls back.
    """
    payload = {name: dict(keyed) for name, keyed in changes.items() if keyed}
    if not payload or not applied.has_listeners():
        return
    if connections[using].in_atomic_block:
        transaction.on_commit(partial(send, payload, using), using=using, robust=True)
    else:
        send(payload, using)


def send(changes: Mapping[str, Mapping[Any, int]], using: str) -> None:
    """Send :data:`applied` once per counter of ``changes``; never raises."""
    for name, deltas in changes.items():
        try:
            applied.send_robust(get_spec(name).model, counter=name, deltas=deltas, using=using)
        except Exception:  # an unknown counter: nothing a receiver could be told
            logger.exception("could not send counters.signals.applied for %s", name)


def publish_live(members: Iterable[str], using: str) -> None:
    """Announce to the watchers of live counters (:mod:`counters.read.watch`) a change of
    ``members`` that did not go through a push (a direct write, a discard), once the current
    transaction commits: now outside ``atomic()``, never if it rolls back. Costs nothing
    while no counter is live."""
    if not live.LIVE_COUNTERS:
        return
    changed = [m for m in members if live.is_live(m)]
    if not changed:
        return
    buffer = get_buffer(using)
    send = partial(live.publish, buffer.client, buffer.prefix, buffer.shards, changed)
    if connections[using].in_atomic_block:
        transaction.on_commit(send, using=using, robust=True)
    else:
        send()
