"""When Redis fails: committed deltas applied to the database directly, recorded in the ledger.

A direct write is one DB transaction: the deltas are applied
(:func:`counters.write.apply.apply_isolating`) and a ``fallback`` row of the
ledger (``FlushBatch``) records them. A push that may still arrive later
leaves the write "unsettled" until a flush fences it
(:mod:`counters.flushing.settle`). Deltas the database refuses go to the
quarantine, like a flush's poison deltas.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping

from django.db import IntegrityError, OperationalError, connections, transaction
from redis import RedisError

from counters.base import metrics
from counters.base.utils import capped
from counters.buffer.pushids import PushId
from counters.client import get_buffer
from counters.models import FALLBACK_PREFIX, FlushBatch
from counters.write import changes, outbox
from counters.write.apply import Applied, apply_isolating

logger = logging.getLogger(__name__)

#: Times the write path sent deltas straight to the DB because Redis failed (this process).
fallback_count = 0


def write_direct(
    deltas: Mapping[str, int],
    using: str,
    *,
    push_id: PushId | str | None = None,
    unsettled: bool = False,
    attempts: int = 3,
    outbox: str | None = None,
    keep: Mapping[str, int] | None = None,
) -> bool:
    """Apply deltas to the DB now, recorded in the ledger as a fallback batch.

    Deltas whose counted row is gone are dropped (and counted), the others
    applied: a row deleted while the transaction ran fails it at COMMIT, and
    the next attempt no longer finds that row. ``outbox``: the outbox row
    holding these deltas (durable mode), deleted in the same transaction, or
    left holding ``keep`` alone when that is not empty; if it is already gone
    (a flush took it), nothing is written.

    True once written; False if the outbox row was gone or the write failed
    (logged: it never raises).
    """

    batch_id = f"{FALLBACK_PREFIX}{push_id or uuid.uuid4().hex}"
    conn = connections[using]
    # Right after the COMMIT of a manual transaction (autocommit off) this
    # write must be a transaction of its own, committed here.
    manual = not conn.in_atomic_block and not conn.get_autocommit()
    for attempt in range(1, attempts + 1):
        try:
            with transaction.atomic(using=using):
                done = _write_once(deltas, using, batch_id, unsettled, outbox, keep)
            if manual:
                conn.commit()
            if done is None:  # the outbox row was gone: a flush counted it
                return False
            _written(*done, using, batch_id)
            changes.publish_live(deltas, using)
            return True
        except (OperationalError, IntegrityError) as exc:
            if manual:
                conn.rollback()
            # A deadlock or lock timeout, or a foreign-key target deleted meanwhile
            # (the deferred check fails at COMMIT): try again.
            if (
                isinstance(exc, IntegrityError)
                and FlushBatch.objects.using(using).filter(pk=batch_id).exists()
            ):
                return True  # this write was applied already
            if attempt == attempts:
                logger.exception(
                    "could not write %s deltas to the DB: %r", len(deltas), capped(deltas)
                )
                return False
            time.sleep(0.05 * attempt)
        except Exception:
            if manual:
                conn.rollback()
            logger.exception("could not write %s deltas to the DB: %r", len(deltas), capped(deltas))
            return False
    return False


def _write_once(
    deltas: Mapping[str, int],
    using: str,
    batch_id: str,
    unsettled: bool,
    row: str | None,
    keep: Mapping[str, int] | None,
) -> tuple[Applied, dict[str, tuple[int, str]]] | None:
    """One attempt of :func:`write_direct`, inside its transaction: what was applied and
    what the database refused; None if outbox row ``row`` is gone (nothing written)."""

    if row is not None:
        found = outbox.update(row, keep, using) if keep else outbox.delete(row, using)
        if not found:
            return None
    applied, refused = apply_isolating(deltas, using)
    FlushBatch.objects.using(using).create(
        batch_id=batch_id,
        kind=FlushBatch.Kind.FALLBACK,
        keys=applied.keys,
        deltas=applied.deltas,
        dropped=applied.dropped,
        unsettled=dict(deltas) if unsettled else None,
    )
    return applied, refused


def _written(
    applied: Applied, refused: dict[str, tuple[int, str]], using: str, batch_id: str
) -> None:
    """A direct write committed: quarantine what the database refused, count it, and
    announce what it changed (``counters.signals.applied``)."""
    global fallback_count
    changes.announce(applied.changes, using)
    if refused:
        set_aside(refused, using, batch_id)
    fallback_count += 1
    metrics.fallback_written(using, applied.keys)


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
