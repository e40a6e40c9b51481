"""Durable mode: the hook that holds a transaction's deltas in the outbox, and the catch-up.

With ``COUNTERS_DURABLE`` on, :data:`hook` is what the transactions call
(:class:`counters.write.transactions.Durable`, injected with ``send`` by
:func:`counters.write.add.add_many`): it writes the deltas of a transaction
to an outbox row (:mod:`counters.write.outbox`) right before the real
COMMIT, under the push id its push will use, and sends them under that id
after it. The writer never deletes the row: each flush runs
:func:`drain_outbox` before it moves batches, which deletes the rows whose
push applied in Redis in one statement.

A writer that dies between COMMIT and its push (SIGKILL, OOM, a lost host)
leaves a row whose push never applies: a row older than
``COUNTERS_OUTBOX_GRACE`` is pushed by the flush with its stored push id and
deleted. Redis remembers a push id for
``PUSH_MARKER_TTL_MS`` (180 s), so a push that did land before the writer
died is not counted twice. A row older than
:data:`counters.write.outbox.OUTBOX_SAFE_AGE` (120 s: the TTL minus a margin
for clock skew and slow flushes) can no longer be pushed safely: its members
are queued for repair from the truth (``<prefix>:repair``, rebuilt by the
same flush) and the row is deleted. A writer whose COMMIT took longer than
the grace claims its row the same way before it pushes (:func:`push_late`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils import timezone

from counters.base import conf, metrics
from counters.base.exceptions import StalePush
from counters.buffer import pushids
from counters.buffer.pushids import PushId
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.models import Outbox
from counters.write import negatives, outbox
from counters.write.delivery import push_exact
from counters.write.fallback import write_direct
from counters.write.outbox import OUTBOX_SAFE_AGE, claim_row
from counters.write.transactions import Sender

logger = logging.getLogger(__name__)

#: Most rows one flush handles per database.
DRAIN_LIMIT = 1000


class OutboxHook:
    """Durable mode as the transactions see it (:class:`counters.write.transactions.Durable`):
    every committed transaction's deltas are in an outbox row until they are counted."""

    def enabled(self) -> bool:
        return conf.write_switches().durable

    def hold(self, deltas: Mapping[str, int], using: str) -> PushId:
        """The outbox row of ``deltas`` under a new push id, on the current transaction."""
        push_id = pushids.allocate()  # held until the push ends it, or the COMMIT fails
        try:
            outbox.write(deltas, using, str(push_id))
        except BaseException:
            self.release(push_id)
            raise
        return push_id

    def release(self, push_id: PushId) -> None:
        pushids.release(push_id)

    def send_held(
        self,
        deltas: Mapping[str, int],
        using: str,
        push_id: PushId,
        held_at: float,
        send: Sender,
    ) -> None:
        """Send the deltas of row ``push_id``, unless the COMMIT took longer than the grace:
        a flush may have pushed the row, so it is claimed first (:func:`push_late`)."""
        late = time.monotonic() - held_at
        if late <= conf.outbox_grace():
            send(deltas, using, push_id=push_id, outbox=True)
            return
        # Pushed by a claim of the row, like a flush does: the writer ends here.
        try:
            push_late(str(push_id), using, late)
        finally:
            pushids.retire(push_id)

    def send_committed(self, deltas: Mapping[str, int], using: str, send: Sender) -> None:
        """The row of a change made with autocommit on, then its push."""
        # Its own statement, right after the change: a process killed in between loses
        # this delta until the audit repairs it (there is no transaction to join).
        push_id = pushids.allocate()  # sent as it is: its text is for the row alone
        try:
            outbox.write(deltas, using, str(push_id))
        except Exception:  # the change is committed: never fail the caller now
            logger.exception("could not write the outbox row of %s deltas", len(deltas))
            send(deltas, using, push_id=push_id)
            return
        send(deltas, using, push_id=push_id, outbox=True)


#: The hook of durable mode that :func:`counters.write.add.add_many` hands the transactions.
hook = OutboxHook()


#: Outcomes of :func:`push_row`.
GONE, PUSHED, DIRECT, REPAIR = "gone", "pushed", "direct", "repair"


def push_row(buffer: Buffer, using: str, push_id: str, age: Callable[[], timedelta]) -> str:
    """Claim outbox row ``push_id`` and push it under its id, in one DB transaction.

    Returns ``GONE`` (another process took it), ``PUSHED``, ``DIRECT`` (pushed,
    and the members Redis cannot sum exactly written to the DB) or ``REPAIR``
    (too old to push safely, ``age()`` past :data:`OUTBOX_SAFE_AGE`, or
    refused as stale: its members are queued for repair from the truth).
    Raises ``RedisError`` when Redis fails: the transaction rolls back and
    the row stays.

    A push made here carries the time of this call: Redis's 30 s limit on a
    push's age is about late network deliveries of an old push, and the push
    id's marker (180 s) is what keeps this push from counting what the
    writer's own push, if it landed, already counted.
    """
    with transaction.atomic(using=using):
        deltas = claim_row(push_id, using)
        if deltas is None:
            return GONE  # its writer deleted it meanwhile (pushed, or wrote it directly)
        seconds = age().total_seconds()
        reason, direct = "", dict[str, int]()
        if seconds > OUTBOX_SAFE_AGE:
            reason = f"{seconds:.0f}s old, beyond the {OUTBOX_SAFE_AGE:.0f}s a push id is safe"
        else:
            rest = dict(deltas)
            try:
                push_exact(buffer, rest, direct, push_id)
            except StalePush:
                reason = "refused by Redis as a stale push"
        if reason:
            if deltas:
                buffer.client.sadd(negatives.queue_key(buffer), *sorted(deltas))
            logger.warning(
                "outbox row %s (%s deltas) not pushed: %s; its keys are queued for repair "
                "from the truth",
                push_id,
                len(deltas),
                reason,
            )
            return REPAIR
        if direct:
            write_direct(direct, using)
            return DIRECT
        return PUSHED


@dataclass
class DrainResult:
    cleared: int = 0  # rows whose push had applied in Redis: deleted, nothing else to do
    pushed: int = 0  # rows pushed by the flush (their writer died or could not push)
    repaired: int = 0  # rows too old to push: their members were queued for repair
    direct: int = 0  # rows (partly) written to the DB (a sum Redis cannot hold exactly)

    def summary(self) -> str:
        return f"outbox: {self.pushed} rows pushed, {self.repaired} too old queued for repair" + (
            f", {self.direct} written to the DB" if self.direct else ""
        )


def drain_outbox(
    buffer: Buffer,
    using: str = DEFAULT_DB_ALIAS,
    *,
    grace: float | None = None,
    limit: int = DRAIN_LIMIT,
) -> DrainResult:
    """Delete the outbox rows whose push applied; push those older than ``grace`` seconds.

    Runs in the flush before it moves batches. First the rows whose push has
    applied in Redis go, in one DELETE (:func:`counters.write.outbox.clear_landed`):
    writers never delete their rows. Then each row older than ``grace`` is
    pushed exactly once and deleted: its writer died, or could not push. A row too old for Redis to
    still remember its push id (:data:`OUTBOX_SAFE_AGE`), or refused as a
    stale push, is not pushed: its members go to the repair queue, which the
    same flush rebuilds from the truth. Raises ``RedisError`` when Redis
    fails: the row being pushed stays (its transaction rolls back) for the
    next flush.
    """

    grace = conf.outbox_grace() if grace is None else grace
    result = DrainResult(cleared=outbox.clear_landed(buffer, using, limit))
    cutoff = timezone.now() - timedelta(seconds=grace)
    due = list(
        Outbox.objects.using(using)
        .filter(created_at__lte=cutoff)
        .order_by("created_at")
        .values_list("push_id", "created_at")[:limit]
    )
    for push_id, created_at in due:
        outcome = push_row(buffer, using, push_id, _age_since(created_at))
        if outcome == PUSHED:
            result.pushed += 1
        elif outcome == REPAIR:
            result.repaired += 1
        elif outcome == DIRECT:
            result.pushed += 1
            result.direct += 1
    if result.pushed or result.repaired:
        logger.info("%s (database %r)", result.summary(), using)
    metrics.outbox_drained(using, result.pushed, result.repaired)
    return result


def clear_applied(buffer: Buffer, using: str = DEFAULT_DB_ALIAS) -> int:
    """After a flush's move and apply: delete the outbox rows whose push applied meanwhile.

    :func:`drain_outbox` runs before the move; a push that applies between
    the two may have been moved and counted by this flush already. Its row
    must not outlive it by a flush interval: if Redis then lost its data (the
    push's mark with it), the row would look unpushed and be pushed again.
    Deleted here, it outlives its count by milliseconds, as when each writer
    deleted its own. Returns how many rows went.
    """
    return outbox.clear_landed(buffer, using)


def _age_since(created_at: datetime) -> Callable[[], timedelta]:
    return lambda: timezone.now() - created_at


def push_late(push_id: str, using: str, seconds: float) -> None:
    """A writer's push ``seconds`` after its outbox row, past ``COUNTERS_OUTBOX_GRACE``.

    A flush may have pushed the row already, long enough ago for Redis to
    forget the push id: the writer claims its row first, like a flush, and
    pushes only if it is still there. Never raises (it runs after COMMIT): a
    row it could not push stays for the flush.
    """
    started = timezone.now() - timedelta(seconds=seconds)
    conn = connections[using]
    # Right after the COMMIT of atomic() or of a manual transaction, autocommit is still
    # off: atomic() then does not commit by itself, so this is committed here.
    manual = not conn.in_atomic_block and not conn.get_autocommit()
    try:
        push_row(get_buffer(using), using, push_id, _age_since(started))
        if manual:
            conn.commit()
    except Exception as exc:
        if manual:
            conn.rollback()
        logger.warning("outbox row %s left for the flush to push: %s", push_id, exc)
