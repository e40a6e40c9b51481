"""Committed deltas delivered: pushed to Redis in one round trip, or written directly.

``add()``/``add_many()`` (:mod:`counters.write.add`) hold deltas until the
transaction commits (:mod:`counters.write.transactions`); :func:`send` then
pushes them to Redis in one round trip, under a push id that makes a repeat
harmless. When Redis fails, :func:`counters.write.fallback.write_direct`
applies them to the database at once, recorded in the ledger; a push that may
still arrive later leaves that write "unsettled" until a flush fences it
(:mod:`counters.flushing.settle`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from redis import RedisError

from counters.base import conf
from counters.base.exceptions import NotConnected, ScoreLimitExceeded, StalePush
from counters.base.utils import capped
from counters.buffer import pushids
from counters.buffer.keyspace import SCORE_LIMIT
from counters.buffer.pushids import PushId
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.write import acks, sender
from counters.write.fallback import write_direct
from counters.write.preflight import ensure_recorded

logger = logging.getLogger(__name__)


def may_have_left(exc: BaseException) -> bool:
    """Could the push that failed with ``exc`` still have reached Redis, or arrive later?

    Only a failure to connect (:class:`NotConnected`) proves that nothing was
    sent. A timeout or a reset after the command was written, an error reply
    from one shard of a pipelined push (the other shards may have applied it),
    a refusal as too late: all may have left something in Redis.
    """
    return not isinstance(exc, NotConnected)


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
    mode) never wait in the sender's queue: they are pushed now, under that
    id (their reply read later with ``COUNTERS_DEFER_ACKS``), so that a later
    push of the row by a flush finds it applied.
    """
    buffer = get_buffer(using)
    # In the committing thread, before any push: the DB knows the layout and the
    # shards' epochs (not in the sender's thread, which has no connection of its own).
    if any(deltas.values()):
        ensure_recorded(buffer, using)
    switches = conf.write_switches()
    if push_id is None and not outbox:
        if switches.send_delay > 0 and sender.enqueue(deltas, using, push_now):
            return
        if switches.defer_acks and acks.send(
            deltas, using, buffer, complete, batch=switches.write_batch
        ):
            return  # its reply is read later; ``complete`` finishes it if it failed
    elif outbox and push_id is not None and switches.defer_acks:
        held = PushId.of(push_id)
        if acks.send(
            deltas, using, buffer, complete_held, push_id=held, batch=switches.write_batch
        ):
            return  # as above; the flush deletes the row once the push applied
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
    :func:`counters.buffer.pushids.allocate`), else a fresh id
    of this process's pushids. Either way it ends the id:
    :func:`counters.buffer.pushids.release` if the push resolved,
    :func:`counters.buffer.pushids.retire` if it may have left without an answer. A
    caller that ends the id again afterwards changes nothing. ``outbox``: the
    deltas are held in the outbox row ``push_id`` (durable mode), which a
    flush deletes once the push applied, or the direct write deletes in its
    transaction (:func:`_send_held`); a push that did not succeed then always
    retires its writer, so a flush that pushes the row later under that id is
    its writer's last number.
    """
    if push_id is None:
        pid = pushids.allocate()
    elif isinstance(push_id, str):
        pid = PushId.parse(push_id)
    else:
        pid = push_id
    resolved = False
    try:
        resolved = _send(deltas, using, pid, outbox)
    finally:
        pushids.finish(pid, resolved)


def complete(deltas: Mapping[str, int], using: str, push_id: PushId, failed: BaseException) -> None:
    """Finish a push of :func:`push_now` whose reply, read later, was ``failed``.

    As if its first attempt had failed so: pushed again under the same id,
    else written directly (unsettled if it may have applied). Ends ``push_id``;
    never raises.
    """
    resolved = False
    try:
        resolved = _send(deltas, using, push_id, False, failed=failed)
    except Exception:
        logger.exception("could not complete push %s", push_id)
    finally:
        pushids.finish(push_id, resolved)


def complete_held(
    deltas: Mapping[str, int], using: str, push_id: PushId, failed: BaseException
) -> None:
    """:func:`complete` for deltas held in outbox row ``push_id`` (durable mode)."""
    resolved = False
    try:
        resolved = _send_held(deltas, using, push_id, failed)
    except Exception:
        logger.exception("could not complete push %s", push_id)
    finally:
        pushids.finish(push_id, resolved)


def _send(
    deltas: Mapping[str, int],
    using: str,
    push_id: PushId,
    outbox: bool,
    failed: BaseException | None = None,
) -> bool:
    """:func:`send`; True if the push resolved (its writer may push again).

    ``failed``: the error of a first attempt made already (a push whose reply
    was read later, :mod:`counters.write.acks`).
    """
    if outbox:
        return _send_held(deltas, using, push_id, failed)
    rest = {member: delta for member, delta in deltas.items() if delta}
    direct: dict[str, int] = {}
    maybe_sent = pushed = False
    attempts: tuple[int, ...] = (1, 2)
    if isinstance(failed, ScoreLimitExceeded):
        _too_large(rest, direct, failed)
    elif failed is not None:
        maybe_sent, attempts = may_have_left(failed), (2,)
    if rest:
        buffer = get_buffer(using)
        for attempt in attempts:
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
    if direct:
        # These never entered Redis: nothing to fence, a settled write.
        write_direct(direct, using)
    if not pushed and rest:
        write_direct(rest, using, push_id=push_id, unsettled=maybe_sent)
    # A push that may have left without an answer (even one a repeat completed)
    # ends its writer: a late delivery is then always the writer's last number.
    return not maybe_sent


class RowTaken(Exception):
    """The outbox row of a push is gone, or could not be changed: the writer stops there."""


def _send_held(
    deltas: Mapping[str, int],
    using: str,
    push_id: PushId,
    failed: BaseException | None = None,
) -> bool:
    """:func:`_send` for deltas held in outbox row ``push_id`` (durable mode).

    The writer does not delete the row after its push: a flush deletes it once
    the push shows as applied in every shard of its members
    (:func:`counters.write.outbox.clear_landed`). So the members Redis cannot
    take (a sum that would reach 2**53) are written to the DB *before* the
    rest of the push can complete, in the transaction that takes them out of
    the row (:func:`_take_out`): a row that shows as applied holds nothing
    left to count. A push that fails writes the rest directly, deleting the
    row in the same transaction; a row already gone was taken by a flush,
    which counts it itself.
    """
    row = str(push_id)
    rest = {member: delta for member, delta in deltas.items() if delta}
    attempts: tuple[int, ...] = (1, 2)
    maybe_sent = False
    try:
        moved = {m: rest.pop(m) for m in [m for m, d in rest.items() if abs(d) >= SCORE_LIMIT]}
        if moved:
            logger.info("%s deltas reach 2**53; writing them to the DB", len(moved))
        if isinstance(failed, ScoreLimitExceeded):
            moved.update(_too_large(rest, {}, failed))
        elif failed is not None:
            maybe_sent, attempts = may_have_left(failed), (2,)
        if moved:
            _take_out(moved, rest, using, row)
        if not rest:
            return not maybe_sent
        buffer = get_buffer(using)
        for attempt in attempts:
            try:
                push_exact(buffer, rest, {}, push_id, lambda m: _take_out(m, rest, using, row))
                return not maybe_sent
            except (RedisError, StalePush) as exc:
                maybe_sent = maybe_sent or may_have_left(exc)
                if attempt == 2:
                    logger.warning(
                        "Redis push failed (%s); writing %s deltas to the DB", exc, len(rest)
                    )
    except RowTaken:
        return False  # the row's fate is a flush's now: this push id is never used again
    write_direct(rest, using, push_id=push_id, unsettled=maybe_sent, outbox=row)
    return False


def _take_out(moved: Mapping[str, int], rest: Mapping[str, int], using: str, row: str) -> None:
    """Write ``moved`` to the DB, leaving outbox row ``row`` with ``rest`` only, in one
    transaction; :class:`RowTaken` if the row is gone (a flush took it) or the write failed
    (the row keeps everything, for a flush to push after the grace)."""
    if not write_direct(moved, using, outbox=row, keep=rest):
        raise RowTaken(row)


def _too_large(
    rest: dict[str, int], direct: dict[str, int], exc: ScoreLimitExceeded
) -> dict[str, int]:
    """Move the members Redis refused as too large from ``rest`` to ``direct``; those moved."""
    moved = {member: rest.pop(member) for member in exc.members}
    direct.update(moved)
    logger.info(
        "%s deltas reach 2**53, beyond exact Redis scores; writing them to the DB: %s",
        len(exc.members),
        capped(exc.members),
    )
    return moved


def push_exact(
    buffer: Buffer,
    rest: dict[str, int],
    direct: dict[str, int],
    push_id: PushId | str,
    before_repeat: Callable[[dict[str, int]], None] | None = None,
) -> None:
    """Push ``rest``, moving the members Redis refuses as too large from ``rest`` to ``direct``.

    A refused shard added nothing, so pushing the remainder again with the
    same id completes it, while the shards that took the push ignore the repeat.
    ``before_repeat`` is called with the members just moved, before that repeat.
    """
    for _ in range(len(rest) + 1):
        try:
            buffer.push(rest, push_id)
            return
        except ScoreLimitExceeded as exc:
            moved = _too_large(rest, direct, exc)
            if before_repeat is not None:
                before_repeat(moved)
    raise AssertionError("unreachable: every refusal removes a member")
