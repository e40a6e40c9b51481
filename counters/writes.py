"""The write path: deltas recorded per transaction, pushed after COMMIT, or written directly.

``add()``/``add_many()`` hold deltas until the transaction commits
(:mod:`counters.transactions`); :func:`send` then pushes them to Redis in one
round trip. When Redis fails, :func:`write_direct` applies them to the
database at once, recorded in the ledger; a push that may still arrive later
leaves that write "unsettled" until a flush fences it (:mod:`counters.settle`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, OperationalError, connections, transaction
from redis import RedisError

from . import metrics, sender, transactions, writers
from .buffer import Buffer
from .client import get_buffer
from .exceptions import NotConnected, ScoreLimitExceeded, StalePush
from .layout import ensure_registered
from .registry import get_spec
from .utils import capped
from .writers import PushId

logger = logging.getLogger(__name__)

#: Times the write path sent deltas straight to the DB because Redis failed (this process).
fallback_count = 0


def add(name: str, key: Any, delta: int = 1, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Add ``delta`` to counter ``name`` at ``key`` once the current transaction commits.

    Raises :class:`InvalidKey` if ``key`` is not a valid key of the counter.
    """
    add_many(name, {key: delta}, using=using)


def add_many(name: str, deltas: Mapping[Any, int], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Add several deltas ({key: delta}) to counter ``name`` after commit.

    Keys are normalised first (``"7"`` and ``7`` are one key, their deltas
    add up); a key that is not valid raises :class:`InvalidKey` and nothing
    of the call is recorded.
    """
    spec = get_spec(name)
    members: dict[str, int] = {}
    for key, delta in deltas.items():
        member = spec.member(key)
        members[member] = members.get(member, 0) + delta
    changed = {member: delta for member, delta in members.items() if delta}
    if changed:
        transactions.record(changed, using, send)


def may_have_left(exc: BaseException) -> bool:
    """Could the push that failed with ``exc`` still have reached Redis, or arrive later?

    Only a failure to connect (:class:`NotConnected`) proves that nothing was
    sent. A timeout or a reset after the command was written, an error reply
    from one shard of a pipelined push (the other shards may have applied it),
    a refusal as too late: all may have left something in Redis.
    """
    return not isinstance(exc, NotConnected)


def new_push_id() -> str:
    """A push id allocated now, before COMMIT, as text (``"<writer>:<seq>"``).

    Its writer is held until :func:`send` ends the id; a caller that does not
    send (its COMMIT failed) must :func:`counters.writers.release` it.
    """
    return str(writers.allocate())


def send(
    deltas: Mapping[str, int],
    using: str,
    *,
    push_id: PushId | str | None = None,
    outbox: bool = False,
) -> None:
    """Hand committed deltas on: to this process's sender when it is on, else push them now.

    Never raises: it runs after COMMIT, where the request has already
    succeeded. Deltas with a push id of their own (an outbox row's, in durable
    mode) are always pushed now, under that id: a later push of the row by a
    flush must find it applied.
    """
    if any(deltas.values()):
        # In the committing thread, before any push: the DB knows the layout and the
        # shards' epochs (not in the sender's thread, which has no connection of its own).
        ensure_registered(get_buffer(using), using)
    queued = push_id is None and not outbox and sender.enabled()
    if queued and sender.enqueue(deltas, using, push_now):
        return
    push_now(deltas, using, push_id=push_id, outbox=outbox)


def push_now(
    deltas: Mapping[str, int],
    using: str,
    *,
    push_id: PushId | str | None = None,
    outbox: bool = False,
) -> None:
    """Push committed deltas to Redis; if Redis fails, apply them to the DB directly.

    Deltas that a Redis score cannot sum exactly (2**53 and beyond) are
    applied to the DB directly as well. Never raises: it runs after COMMIT,
    where the request has already succeeded.

    The push uses ``push_id`` when given (allocated before COMMIT with
    :func:`new_push_id` or :func:`counters.writers.allocate`), else a fresh id
    of this process's writers. Either way it ends the id:
    :func:`counters.writers.release` if the push resolved,
    :func:`counters.writers.retire` if it may have left without an answer. A
    caller that ends the id again afterwards changes nothing. ``outbox``: the
    deltas are held in the outbox row ``push_id`` (durable mode), deleted once
    they are counted: after the push, or in the transaction of the direct
    write; a push that did not succeed then always retires its writer, so a
    flush that pushes the row later under that id is its writer's last number.
    """
    if push_id is None:
        pid = writers.allocate()
    elif isinstance(push_id, str):
        pid = PushId.parse(push_id)
    else:
        pid = push_id
    resolved = False
    try:
        resolved = _send(deltas, using, pid, outbox)
    finally:
        writers.finish(pid, resolved)


def _send(deltas: Mapping[str, int], using: str, push_id: PushId, outbox: bool) -> bool:
    """:func:`send`; True if the push resolved (its writer may push again)."""
    rest = {member: delta for member, delta in deltas.items() if delta}
    direct: dict[str, int] = {}
    maybe_sent = pushed = False
    if rest:
        buffer = get_buffer(using)
        for attempt in (1, 2):
            try:
                push_exact(buffer, rest, direct, push_id)
                pushed = True
                break
            except (RedisError, StalePush) as exc:
                # The push is idempotent per push id, so one repeat is safe even if
                # the first attempt ran and only its reply was lost. A failure after
                # the command left (a timeout, a reset) may still deliver it later:
                # the direct write then stays unsettled until a flush fences it.
                maybe_sent = maybe_sent or may_have_left(exc)
                if attempt == 2:
                    logger.warning(
                        "Redis push failed (%s); writing %s deltas to the DB", exc, len(rest)
                    )
    else:
        pushed = True
    if outbox:
        send_outbox(rest, direct, using, str(push_id), pushed=pushed, maybe_sent=maybe_sent)
        return pushed and not maybe_sent
    if direct:
        # These never entered Redis: nothing to fence, a settled write.
        write_direct(direct, using)
    if not pushed and rest:
        write_direct(rest, using, push_id=push_id, unsettled=maybe_sent)
    # A push that may have left without an answer (even one a repeat completed)
    # ends its writer: a late delivery is then always the writer's last number.
    return not maybe_sent


def send_outbox(
    rest: dict[str, int],
    direct: dict[str, int],
    using: str,
    push_id: str,
    *,
    pushed: bool,
    maybe_sent: bool,
) -> None:
    """The end of :func:`send` for deltas held in outbox row ``push_id``: delete the row.

    Once pushed, the row goes (one DELETE); the members Redis refused are
    written directly in the same transaction as the DELETE. Not pushed, the
    direct write of the rest deletes the row. If the row is gone, a flush
    took it (pushed it itself): that direct write is skipped.
    """
    from . import outbox as outbox_rows

    if pushed and not direct:
        try:
            outbox_rows.forget(push_id, using)
        except Exception:  # the next flush pushes it again, under the same id: counted once
            logger.exception("could not delete outbox row %s", push_id)
        return
    if pushed:
        write_direct(direct, using, outbox=push_id)
        return
    if direct:
        # Never in Redis, so never fenced: kept apart from the unsettled write below,
        # whose fence could find this push id applied in their shard by a later attempt.
        # (A process killed between the two writes has them pushed again by the flush.)
        write_direct(direct, using)
    write_direct(rest, using, push_id=push_id, unsettled=maybe_sent, outbox=push_id)


def push_exact(
    buffer: Buffer, rest: dict[str, int], direct: dict[str, int], push_id: PushId | str
) -> None:
    """Push ``rest``, moving the members Redis refuses as too large from ``rest`` to ``direct``.

    A refused shard added nothing, so pushing the remainder again with the
    same id completes it, while the shards that took the push ignore the repeat.
    """
    for _ in range(len(rest) + 1):
        try:
            buffer.push(rest, push_id)
            return
        except ScoreLimitExceeded as exc:
            for member in exc.members:
                direct[member] = rest.pop(member)
            logger.info(
                "%s deltas reach 2**53, beyond exact Redis scores; writing them to the DB: %s",
                len(exc.members),
                capped(exc.members),
            )
    raise AssertionError("unreachable: every refusal removes a member")


def write_direct(
    deltas: Mapping[str, int],
    using: str,
    *,
    push_id: PushId | str | None = None,
    unsettled: bool = False,
    attempts: int = 3,
    outbox: str | None = None,
) -> None:
    """Apply deltas to the DB now, recorded in the ledger as a fallback batch.

    Deltas whose counted row is gone are dropped (and counted), the others
    applied: a row deleted while the transaction ran fails it at COMMIT, and
    the next attempt no longer finds that row. ``outbox``: the outbox row
    holding these deltas (durable mode), deleted in the same transaction; if
    it is already gone (a flush pushed it), nothing is written.
    """
    global fallback_count
    from .apply import apply_isolating
    from .models import FALLBACK_PREFIX, FlushBatch

    batch_id = f"{FALLBACK_PREFIX}{push_id or uuid.uuid4().hex}"
    ledger = FlushBatch.objects.using(using)
    conn = connections[using]
    # Right after the COMMIT of a manual transaction (autocommit off) this
    # write must be a transaction of its own, committed here.
    manual = not conn.in_atomic_block and not conn.get_autocommit()
    for attempt in range(1, attempts + 1):
        try:
            with transaction.atomic(using=using):
                # Gone: a flush took the row and counted the deltas through Redis.
                mine = outbox is None or _claim_outbox(outbox, using)
                refused: dict[str, tuple[int, str]] = {}
                if mine:
                    applied, refused = apply_isolating(deltas, using)
                    ledger.create(
                        batch_id=batch_id,
                        kind=FlushBatch.Kind.FALLBACK,
                        keys=applied.keys,
                        deltas=applied.deltas,
                        dropped=applied.dropped,
                        unsettled=dict(deltas) if unsettled else None,
                    )
            if manual:
                conn.commit()
            if refused:
                set_aside(refused, using, batch_id)
            if not mine:
                return
            fallback_count += 1
            metrics.fallback_written(using, applied.keys)
            return
        except (OperationalError, IntegrityError) as exc:
            if manual:
                conn.rollback()
            # A deadlock or lock timeout, or a foreign-key target deleted meanwhile
            # (the deferred check fails at COMMIT): try again.
            if isinstance(exc, IntegrityError) and ledger.filter(pk=batch_id).exists():
                return  # this write was applied already
            if attempt == attempts:
                logger.exception(
                    "could not write %s deltas to the DB: %r", len(deltas), capped(deltas)
                )
                return
            time.sleep(0.05 * attempt)
        except Exception:
            if manual:
                conn.rollback()
            logger.exception("could not write %s deltas to the DB: %r", len(deltas), capped(deltas))
            return


def set_aside(refused: dict[str, tuple[int, str]], using: str, origin: str) -> None:
    """Quarantine ``{member: (delta, error)}`` that a direct write could not apply.

    They never entered Redis (a delta too large for a score, or Redis was
    down), and the database refused them (a value beyond the column's range):
    like a flush's poison deltas they are held in the quarantine, shown by
    ``counters_status``, until retried or discarded. Only if Redis cannot
    take them either are they lost, logged with their values.
    """
    deltas = {member: delta for member, (delta, _) in refused.items()}
    errors = sorted({error for _, error in refused.values()})
    try:
        get_buffer(using).set_aside(refused, origin)
    except RedisError:
        logger.exception(
            "could not quarantine %s deltas the DB refused (%s); lost: %r",
            len(refused),
            "; ".join(errors),
            capped(deltas),
        )
        return
    logger.error(
        "quarantined %s deltas the DB refused (%s): %s; see counters_status, then "
        "counters_flush --retry-quarantined or --discard-quarantined",
        len(refused),
        "; ".join(errors),
        capped(deltas),
    )


def _claim_outbox(push_id: str, using: str) -> bool:
    from .outbox import delete

    return delete(push_id, using)
