"""Drain the buffer into counter rows, shard by shard: move, apply, isolate, acknowledge.

Exactly once: the batch id is inserted into the :class:`FlushBatch` ledger in
the same transaction as the counter updates. Whatever point a flusher dies
at, the batch stays in the shard's in-flight set until the next flush, which
applies it if its id is not in the ledger and only acknowledges it if it is.
Two flushers racing on one batch (a lease that expired mid-apply) collide on
the ledger's primary key, so one of them applies it.

Poison isolation: a batch that fails to apply for any reason but the state of
the database (:data:`SYSTEMIC`: a lost connection, a deadlock, a lock
timeout, a read-only database, a counter table renamed or missing in a
deploy window; the batch stays in flight and the shard fails this run) is
narrowed in Redis: its first half stays in flight as a batch of its own, with
the shard's next batch sequence number (see :mod:`counters.flushing.epoch`), and
its second half goes back to pending, moved next by itself. A binary search:
1000 members with one poison delta cost 11 failed transactions. A member that
fails alone is quarantined with its error (:mod:`counters.flushing.quarantine`).
Every step is one atomic script that checks the batch id in flight, so the
in-flight batch is always exactly what its ledger id covers: a crash at any
point leaves a batch that the next flush applies or only acknowledges, and
reads never count a delta twice.

The steps of one shard's flush are the methods of :class:`ShardFlush`, each
stating its invariant: begin (the epoch check), move, apply, isolate and
acknowledge, under the shard's lease. :func:`counters.flushing.lanes.flush_buffer`
flushes each shard.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import replace

from django.db import DatabaseError, IntegrityError, connections

from counters.buffer.lease import Lease
from counters.buffer.store import Batch, Buffer
from counters.flushing import ledger, waits
from counters.flushing.epoch import check_epoch, record_loss
from counters.flushing.quarantine import BatchLost, narrow_or_quarantine
from counters.flushing.result import FlushResult
from counters.models import FlushBatch
from counters.write import changes
from counters.write.apply import DATABASE_ERRORS, apply_deltas, prepare_deltas

logger = logging.getLogger(__name__)


#: Errors of the database rather than of a batch's deltas: the batch stays in flight as
#: it is and the shard fails this run (the next flush tries again).
SYSTEMIC = DATABASE_ERRORS


def new_batch_id() -> str:
    return uuid.uuid4().hex


#: The lanes' turn at the database (:class:`~counters.flushing.lanes.Lanes`) that
#: :func:`apply_batch` takes in this thread, set by :meth:`ShardFlush.apply`; None with one
#: lane.
_turn: ContextVar[threading.Lock | None] = ContextVar("counters_flush_turn", default=None)


def apply_batch(batch: Batch, using: str, result: FlushResult) -> None:
    """Apply ``batch`` unless the ledger says it already was. Raises on DB errors.

    Its ledger row and its counter updates are one transaction: both commit,
    or neither does. A recovered batch whose row is in the ledger, and a batch
    whose row another flusher committed first (the primary key collides), are
    only counted as ``already_applied``. Under :func:`counters.flushing.waits.limited`
    (the flush loop), the transaction's lock waits, statements and idle time
    are bounded: a lock timeout raises ``OperationalError``.

    With lanes, their turn at the database is held from before BEGIN until
    the transaction's last statement has returned: the COMMIT, and what
    follows it, run beside the next lane's statements.
    """
    rows = FlushBatch.objects.using(using)
    if batch.recovered and rows.filter(pk=batch.batch_id).exists():
        result.already_applied += 1
        return
    try:
        with ExitStack() as held:
            turn = _turn.get()
            if turn is not None:
                held.enter_context(turn)
            with waits.atomic(using):
                # The ledger row goes first: a second applier of the same batch
                # waits on this primary key and then fails instead of adding twice.
                ledger.record_batch(batch, using)
                applied = apply_deltas(batch.items, using)
                if applied.dropped:
                    rows.filter(pk=batch.batch_id).update(
                        dropped=applied.dropped, keys=applied.keys, deltas=applied.deltas
                    )
                held.close()  # statements done: the COMMIT runs beside the next lane's
    except IntegrityError:
        if rows.filter(pk=batch.batch_id).exists():
            result.already_applied += 1
            return
        raise
    changes.announce(applied.changes, using)  # committed: counters.signals.applied
    result.batches += 1
    result.keys += applied.keys
    result.deltas += applied.deltas
    result.dropped += applied.dropped


class ShardFlush:
    """One flush of one shard under its lease: move, apply (or isolate), acknowledge, again.

    It drains what the shard held when it began (``target`` members moved), so
    that a steady stream of writes cannot keep one flush going; the members a
    narrowed batch sent back are moved next, by themselves, before anything new.
    """

    def __init__(
        self,
        buffer: Buffer,
        shard: int,
        *,
        using: str,
        batch_size: int,
        lease_timeout: float,
        deadline: float,
        result: FlushResult,
        turn: threading.Lock | None = None,
    ) -> None:
        self.buffer, self.shard, self.using = buffer, shard, using
        #: Held while a batch is applied when lanes share the database
        #: (:class:`~counters.flushing.lanes.Lanes`).
        self.turn = turn
        self.batch_size, self.lease_timeout, self.deadline = batch_size, lease_timeout, deadline
        self.result = result
        self.lease = Lease(buffer.client, buffer.key(shard, "lease"), lease_timeout)
        #: The shard's highest batch sequence number the DB applied: only this holder raises it.
        self.applied_seq = 0
        #: Members pending when the flush began, and how many of them it has moved.
        self.target = self.moved = 0
        #: The half of a failed batch kept in flight under a new id: applied next.
        self.narrowed: Batch | None = None
        #: Members narrowed batches sent back to pending: each group is moved by itself next,
        #: so that a poison delta is found in halvings, not mixed with new deltas.
        self.returned: list[list[str]] = []
        #: The batch applied last: acknowledged by the next move, or at the end.
        self.unacked: str | None = None

    def run(self) -> None:
        """Drain the shard, or list it in ``busy_shards`` when another flusher holds its lease.

        An exception leaves the batch applied last in flight, unacknowledged:
        the next flush finds it in the ledger and only acknowledges it.
        """
        with self.lease:
            if not self.lease.held:
                self.result.busy_shards.append(self.shard)
                return
            self.begin()
            self.drain()
            self.acknowledge()

    def begin(self) -> None:
        """Check the shard's epoch before the first move, and count what it holds now.

        Invariant: a Redis that lost data or went back in time since the DB last
        applied one of its batches is recorded as a loss (``lost_shards``) before
        anything moves; ``applied_seq`` starts from the DB's sequence of the shard.
        """
        epoch = check_epoch(self.buffer, self.shard, self.using)
        if epoch.lost:
            self.result.lost_shards.append(self.shard)
        self.applied_seq = epoch.seq
        self.target = self.buffer.pending_count(self.shard)

    def drain(self) -> None:
        """Move, apply or isolate, batch after batch, until ``target`` members have moved.

        Stops early, the rest left pending, once the budget or the lease runs out
        (:meth:`may_go_on`) or the batch in flight is no longer this flusher's.
        """
        batch: Batch | None
        while self.may_go_on():
            if self.narrowed is not None:
                batch, self.narrowed = self.narrowed, None
            else:
                only = self.returned.pop() if self.returned else None
                batch = self.move(only)
                if batch is None:
                    if only is None:
                        return  # nothing pending: the shard is drained
                    continue  # none of the members sent back is pending any more
            try:
                if batch.items and not self.apply(batch):
                    if self.narrowed is None and self.counted(batch):
                        return  # quarantined, and the last of the target
                    continue
            except BatchLost:
                logger.warning(
                    "batch %s of shard %s is no longer in flight; stopping this shard",
                    batch.batch_id,
                    self.shard,
                )
                return
            self.unacked = batch.batch_id
            if self.counted(batch):
                return

    def may_go_on(self) -> bool:
        """True while the time budget lasts and the lease is held, renewed past half its time.

        Invariant: no batch is moved once the budget is spent (``incomplete``) or
        the lease could not be renewed (another flusher may hold the shard).
        """
        if time.monotonic() >= self.deadline:
            self.result.incomplete = True
            return False
        if self.lease.remaining() < self.lease_timeout / 2 and not self.lease.extend():
            logger.warning("lost the lease of shard %s; stopping this shard", self.shard)
            return False
        return True

    def move(self, only: list[str] | None = None) -> Batch | None:
        """Move pending members (or only those of ``only``) in flight under a new batch id.

        Invariant: one script acknowledges the batch applied last (if it is still
        the one in flight), then moves pending members in flight under a fresh id;
        a batch already in flight (its flusher died before acknowledging it) is
        returned instead, ``recovered``, and nothing moves. A new batch numbered at
        or below what the DB applied means Redis went back in time mid-flush: a loss.
        None when nothing (of ``only``) is pending.
        """
        ack, self.unacked = self.unacked, None
        batch = self.buffer.move(
            self.shard, new_batch_id(), self.batch_size, only=only or (), ack=ack
        )
        if batch is None:
            return None
        if batch.recovered:
            self.result.recovered += 1
            logger.info("recovering in-flight batch %s of shard %s", batch.batch_id, self.shard)
        elif (
            batch.seq
            and batch.seq <= self.applied_seq
            and self.shard not in self.result.lost_shards
        ):
            # Redis went back in time since this flush checked it (a failover mid-flush).
            record_loss(self.buffer, self.shard, self.using, batch.seq)
            self.result.lost_shards.append(self.shard)
        return batch

    def apply(self, batch: Batch) -> bool:
        """Apply ``batch`` (:func:`apply_batch`); on an error of its deltas, isolate it.

        Invariant: the counter updates and the ledger row commit in one
        transaction, within the limits of the budget and the lease; True once
        the DB holds the batch (now or before: a recovered batch is replayed only
        if the ledger lacks it). An error of the database (:data:`SYSTEMIC`, or a
        connection no longer usable) propagates with the batch in flight as it
        is; any other error isolates the batch (:meth:`isolate`) and returns False.
        """
        limits = waits.apply_limits(self.lease_timeout, self.deadline - time.monotonic())
        batch = prepared(batch, self.using)
        try:
            with waits.limited(limits), taking_turns(self.turn):
                apply_batch(batch, self.using, self.result)
        except SYSTEMIC:
            raise  # the database, not the deltas: the batch stays in flight as it is
        except Exception as exc:
            if database_gone(self.using):
                raise
            self.isolate(batch, exc)
            return False
        self.applied_seq = max(self.applied_seq, batch.seq)
        return True

    def isolate(self, batch: Batch, exc: Exception) -> None:
        """Narrow failed ``batch`` to its first half, or quarantine it (``narrow_or_quarantine``).

        Invariant: a member that cannot be applied never holds up the others. The
        half kept in flight is applied next (``narrowed``); the half sent back
        to pending is moved by itself after it. A member that fails alone is
        quarantined (not applied, not lost). Raises :class:`BatchLost` if
        ``batch`` is no longer in flight.
        """
        self.narrowed = narrow_or_quarantine(self.buffer, batch, exc, self.result)
        if self.narrowed is not None:
            self.returned.append(sorted(set(batch.items) - set(self.narrowed.items)))
            if batch.recovered:
                # Members it sent back were not counted when this run began.
                self.target += len(batch.items) - len(self.narrowed.items)

    def acknowledge(self) -> None:
        """Drop the batch applied last from the shard's in-flight set, by its id.

        Invariant: only a batch the ledger holds is acknowledged, and only while
        it is still the batch in flight: one another flusher moved meanwhile
        (this lease expired) stays. Each earlier batch was acknowledged by the
        move that followed it.
        """
        if self.unacked is not None:
            self.buffer.ack(self.shard, self.unacked)
            self.unacked = None

    def counted(self, batch: Batch) -> bool:
        """Count ``batch``'s members as moved; True once the target is moved and none is sent back.

        A recovered batch was in flight before this run began: not counted.
        """
        if batch.recovered:
            return False
        self.moved += len(batch.items)
        return self.moved >= self.target and not self.returned


@contextmanager
def taking_turns(turn: threading.Lock | None) -> Iterator[None]:
    """Have :func:`apply_batch` hold ``turn`` for its statements within the block."""
    token = _turn.set(turn)
    try:
        yield
    finally:
        _turn.reset(token)


def prepared(batch: Batch, using: str) -> Batch:
    """``batch`` with its items :class:`~counters.write.apply.Prepared`, before the turn.

    The grouping and the statements are built while another lane's batch is in
    the database, so a turn holds the database's work and little Python. A
    batch that cannot be prepared (a member no counter reads) is returned as
    it is: :func:`apply_batch` meets the same error, and the batch is
    isolated as any other that fails there.
    """
    try:
        items = prepare_deltas(batch.items, using)
    except Exception:
        return batch
    return replace(batch, items=items)


def database_gone(using: str) -> bool:
    """Whether this thread cannot reach database ``using``: its connection fails a query.

    A lane's connection may not be open yet (its shard failed before its
    first query): it is opened first, so that it is not taken for a lost one.
    """
    conn = connections[using]
    try:
        conn.ensure_connection()
    except DatabaseError:
        return True
    return not conn.is_usable()
