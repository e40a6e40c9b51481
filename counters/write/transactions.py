"""Deltas held per database transaction and sent once, right after the real COMMIT.

Only what commits counts. This module follows every way Django lets a
transaction end or partly roll back:

- ``commit()``, whether ``atomic()`` calls it or the caller does in a manual
  transaction (``set_autocommit(False)``): the deltas are sent right after
  the COMMIT, before Django runs any ``on_commit`` callback, so another
  callback that raises (a broker that is down) cannot keep them from going,
  and a manual transaction's deltas go even if the connection is closed
  before autocommit comes back (Django would drop its callbacks then).
- ``rollback()`` and ``close()`` drop them.
- Savepoints, ``atomic()``'s and manual ones (``transaction.savepoint()`` /
  ``savepoint_rollback()``): a rollback to a savepoint drops the deltas
  recorded while it was open.

Django has no hook for a manual commit or savepoint, so the connection's
``commit``, ``rollback``, ``close`` and ``savepoint*`` methods are wrapped
(once per connection object, when it connects). Inside ``atomic()`` a robust
``on_commit`` callback is queued as well: it finds nothing left to send after
a real COMMIT, and it is what sends the deltas where no COMMIT ever happens
but the callbacks are run (``TestCase.captureOnCommitCallbacks(execute=True)``).
Outside a transaction, with autocommit on, the change is already committed
and its deltas go at once.

Who receives the deltas is injected with them (:func:`record`): the
``send`` to call after the COMMIT, and the hook of durable mode
(``COUNTERS_DURABLE``, :class:`Durable`, implemented in
:mod:`counters.write.durable`). In durable mode the wrapped ``commit()`` first
has the hook write the transaction's deltas to an outbox row under a new push
id, inside the transaction, then COMMITs, then has it send them under that id;
the row is deleted once they are counted. With autocommit on, the hook writes
the row right after the change (its own statement): a process killed between
the two loses that delta until the audit repairs it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from counters.buffer.pushids import PushId

logger = logging.getLogger(__name__)

#: ``send(deltas, using)``, or ``send(deltas, using, push_id=..., outbox=True)`` when the
#: deltas are held in an outbox row (see :func:`counters.write.delivery.send`).
Sender = Callable[..., None]


class Durable(Protocol):
    """Durable mode, as the transactions see it: an outbox row holds a transaction's deltas
    from before its COMMIT until they are counted. Injected with ``send`` (:func:`record`)."""

    def enabled(self) -> bool:
        """Is durable mode on (``COUNTERS_DURABLE``)?"""
        ...

    def hold(self, deltas: Mapping[str, int], using: str) -> PushId:
        """Inside the transaction, right before its COMMIT: write ``deltas`` to an outbox row
        under a new push id, returned. Raises (the COMMIT must fail) with the id released."""
        ...

    def release(self, push_id: PushId) -> None:
        """The COMMIT failed: ``push_id`` is never pushed."""
        ...

    def send_held(
        self,
        deltas: Mapping[str, int],
        using: str,
        push_id: PushId,
        held_at: float,
        send: Sender,
    ) -> None:
        """After the COMMIT: send ``deltas``, held in row ``push_id`` since ``held_at``
        (``time.monotonic()``), with ``send`` under that id."""
        ...

    def send_committed(self, deltas: Mapping[str, int], using: str, send: Sender) -> None:
        """A change made with autocommit on (committed already): its row, then ``send``."""
        ...


_tokens = itertools.count(1)


class _Transaction:
    """The deltas recorded in the current transaction of one connection.

    Each delta is kept under the savepoints that were open when it was
    recorded (as tokens: savepoint ids repeat across transactions).
    """

    def __init__(self) -> None:
        self.by_context: dict[tuple[int, ...], Counter[str]] = {}
        self.open: list[tuple[str, int]] = []  # (savepoint id, token), oldest first
        self.send: Sender | None = None
        self.durable: Durable | None = None
        self.callback_queued = False
        #: The savepoints (tokens) open when the ``on_commit`` callback was queued.
        self.callback_context: tuple[int, ...] = ()

    def record(self, deltas: Mapping[str, int], send: Sender, durable: Durable | None) -> None:
        context = tuple(token for _, token in self.open)
        bucket = self.by_context.get(context)
        if bucket is None:
            bucket = self.by_context[context] = Counter()
        bucket.update(deltas)
        self.send = send
        self.durable = durable

    def opened(self, sid: str) -> None:
        self.open.append((sid, next(_tokens)))

    def released(self, sid: str) -> None:
        for i in range(len(self.open) - 1, -1, -1):
            if self.open[i][0] == sid:
                del self.open[i:]  # releasing a savepoint releases the ones opened after it
                return

    def rolled_back(self, sid: str) -> None:
        token = next((t for s, t in reversed(self.open) if s == sid), None)
        if token is None:
            # Opened before this connection was followed, so before every delta held here.
            self.by_context.clear()
            self.callback_queued = False
            return
        if token in self.callback_context:  # Django dropped the callback with the savepoint
            self.callback_queued = False
        index = next(i for i, (_, t) in enumerate(self.open) if t == token)
        del self.open[index + 1 :]  # savepoints opened after it are gone too
        for context in [c for c in self.by_context if token in c]:
            del self.by_context[context]

    def merged(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for bucket in self.by_context.values():
            total.update(bucket)
        return {member: delta for member, delta in total.items() if delta}

    def take(self) -> tuple[dict[str, int], Sender | None, Durable | None]:
        """The deltas to send now that the transaction committed, and to whom; forgets them."""
        deltas, send, durable = self.merged(), self.send, self.durable
        self.reset()
        return deltas, send, durable

    def reset(self) -> None:
        self.by_context.clear()
        self.open.clear()
        self.send = None
        self.durable = None
        self.callback_queued = False
        self.callback_context = ()


def _state(conn: BaseDatabaseWrapper) -> _Transaction:
    state = conn.__dict__.get("_counters_transaction")
    if state is None:
        follow(conn)
        state = conn.__dict__["_counters_transaction"]
    return state


def _deliver(
    conn: BaseDatabaseWrapper,
    state: _Transaction,
    push_id: PushId | None = None,
    written_at: float = 0.0,
) -> None:
    deltas, send, durable = state.take()
    if deltas and send is not None:
        try:
            if push_id is None:
                send(deltas, conn.alias)
            elif durable is not None:
                durable.send_held(deltas, conn.alias, push_id, written_at, send)
        except Exception:  # the transaction has committed: never fail the caller now
            logger.exception("could not send %s committed deltas", len(deltas))


def _write_outbox(conn: BaseDatabaseWrapper, state: _Transaction) -> PushId | None:
    """In durable mode, write the deltas about to commit to an outbox row; its push id.

    Runs inside the transaction, right before the real COMMIT. An error
    (the outbox table missing) fails the COMMIT: durable mode promised this row.
    """
    durable = state.durable
    if not state.by_context or state.send is None or durable is None or not durable.enabled():
        return None
    deltas = state.merged()
    if not deltas:
        return None
    return durable.hold(deltas, conn.alias)


def connection_created(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """``connection_created`` receiver: follow the transactions of every connection."""
    follow(connection)


def follow(conn: BaseDatabaseWrapper) -> None:
    """Follow the transactions of ``conn``; idempotent.

    The connection's own methods are replaced, on this instance only: the
    COMMIT sends what the transaction recorded, a rollback or a close drops it.
    """
    if "_counters_transaction" in conn.__dict__:
        return
    state = _Transaction()
    conn.__dict__["_counters_transaction"] = state
    commit, rollback, close = conn.commit, conn.rollback, conn.close

    def counted_commit() -> None:
        durable = state.durable
        push_id = _write_outbox(conn, state)
        written_at = time.monotonic()
        try:
            commit()
        except BaseException:
            if push_id is not None and durable is not None:  # never committed:
                durable.release(push_id)  # its number is never pushed
            raise
        _deliver(conn, state, push_id, written_at)

    def counted_rollback() -> None:
        try:
            rollback()
        finally:
            state.reset()

    def counted_close() -> None:
        try:
            close()
        finally:
            state.reset()  # an open transaction is rolled back by the database

    wrapped: Any = conn
    wrapped.commit = counted_commit
    wrapped.rollback = counted_rollback
    wrapped.close = counted_close
    _follow_savepoints(conn, state)


def _follow_savepoints(conn: BaseDatabaseWrapper, state: _Transaction) -> None:
    """Wrap ``conn``'s savepoint methods: a rollback to a savepoint drops what was recorded
    while it was open (on this instance only)."""
    savepoint, savepoint_rollback, savepoint_commit = (
        conn.savepoint,
        conn.savepoint_rollback,
        conn.savepoint_commit,
    )

    def counted_savepoint() -> str | None:
        sid = savepoint()
        if sid is not None:
            state.opened(sid)
        return sid

    def counted_savepoint_rollback(sid: str) -> None:
        savepoint_rollback(sid)
        if sid is not None:
            state.rolled_back(sid)

    def counted_savepoint_commit(sid: str) -> None:
        savepoint_commit(sid)
        if sid is not None:
            state.released(sid)

    wrapped: Any = conn
    wrapped.savepoint = counted_savepoint
    wrapped.savepoint_rollback = counted_savepoint_rollback
    wrapped.savepoint_commit = counted_savepoint_commit


def record(
    deltas: Mapping[str, int],
    using: str,
    send: Sender,
    durable: Durable | None = None,
) -> None:
    """Have ``send(deltas, using)`` called once the current transaction on ``using`` commits.

    ``deltas`` holds no zero (:mod:`counters.write.add` leaves them out). Deltas
    of one transaction are summed per member and sent in one call.
    ``durable``: the hook of durable mode, which holds them in an outbox row
    from before the COMMIT until they are counted (when it is enabled).
    """
    conn = connections[using]
    in_atomic = conn.in_atomic_block
    if not in_atomic and conn.get_autocommit():
        if durable is not None and durable.enabled():
            durable.send_committed(deltas, using, send)
        else:
            send(deltas, using)
        return
    state = _state(conn)
    state.record(deltas, send, durable)
    if in_atomic and not state.callback_queued:
        _queue_callback(conn, state)


def _queue_callback(conn: BaseDatabaseWrapper, state: _Transaction) -> None:
    """Queue the robust ``on_commit`` callback that sends ``state``'s deltas where no real
    COMMIT happens but the callbacks run; the savepoints open now are its context.

    Django drops a callback when a savepoint open at its ``on_commit()`` is rolled
    back, with every delta recorded since (the callback is queued at the first one):
    :meth:`_Transaction.rolled_back` then clears ``callback_queued``, and the next
    delta recorded queues it again.
    """
    state.callback_queued = True
    state.callback_context = tuple(token for _, token in state.open)
    transaction.on_commit(lambda: _deliver(conn, state), using=conn.alias, robust=True)


def unsent(members: Iterable[str], using: str = DEFAULT_DB_ALIAS) -> dict[str, int]:
    """Deltas of ``members`` recorded by the current transaction on ``using``, not yet sent.

    A read inside a transaction adds them, so it sees its own changes.
    """
    conn = connections[using]
    state = conn.__dict__.get("_counters_transaction")
    if state is None or not state.by_context:
        return {}
    merged = state.merged()
    return {member: merged[member] for member in members if merged.get(member)}
