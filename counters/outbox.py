"""Per-transaction accumulation of deltas, sent once after COMMIT.

Inside ``atomic()`` every ``record()`` lands in an accumulator bound to the
current savepoint context and registered with ``connection.on_commit``.
Django discards the callbacks of a savepoint that rolls back, and with them
the deltas recorded inside it. The connection's registry holds accumulators
by weak reference only, so a discarded one disappears from it too. After
COMMIT the first accumulator to run merges every surviving one and sends them
in a single call; the others find themselves done. Outside a transaction the
deltas are sent at once: the change they describe is already committed.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Mapping

from django.db import connections

Sender = Callable[[Mapping[str, int], str], None]


class _Accumulator:
    """An on_commit callback carrying the deltas of one savepoint context."""

    def __init__(self, context: tuple[str, ...], using: str, send: Sender) -> None:
        self.context = context
        self.using = using
        self.send = send
        self.deltas: Counter[str] = Counter()
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        registry = _registries.get(connections[self.using], [])
        group = [acc for acc in (ref() for ref in registry) if acc is not None and not acc.done]
        if self not in group:
            group.append(self)
        registry.clear()
        merged: Counter[str] = Counter()
        for acc in group:
            acc.done = True
            merged.update(acc.deltas)
        deltas = {member: delta for member, delta in merged.items() if delta}
        if deltas:
            self.send(deltas, self.using)


#: connection -> weak references to its accumulators that may still run.
_registries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record(deltas: Mapping[str, int], using: str, send: Sender) -> None:
    """Send ``deltas`` ({member: delta}) after the current transaction on ``using`` commits."""
    conn = connections[using]
    if not conn.in_atomic_block:
        now = {member: delta for member, delta in deltas.items() if delta}
        if now:
            send(now, using)
        return
    context = tuple(sid for sid in conn.savepoint_ids if sid)
    # The connection's queue of callbacks is the truth about what will run at COMMIT.
    queued = [
        entry[1]
        for entry in conn.run_on_commit
        if isinstance(entry[1], _Accumulator) and not entry[1].done
    ]
    for acc in reversed(queued):
        if acc.context == context:
            break
    else:
        acc = _Accumulator(context, using, send)
        conn.on_commit(acc, robust=True)
        queued.append(acc)
        _registries[conn] = [weakref.ref(a) for a in queued]
    acc.deltas.update(deltas)
