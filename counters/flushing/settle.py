"""Settling direct writes whose push may still arrive in Redis.

A push that timed out can reach Redis later (a healed partition, a stalled
server) although the writer already wrote its deltas to the database. Each
flush fences such pushes first; one that did land is taken back.
"""

from __future__ import annotations

import logging

from django.db import DEFAULT_DB_ALIAS
from django.utils import timezone
from redis import RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from counters.base import metrics
from counters.base.exceptions import StalePush
from counters.buffer.pushids import PushId
from counters.buffer.store import PUSH_MARKER_TTL_MS, Buffer
from counters.models import FALLBACK_PREFIX, FlushBatch
from counters.write.delivery import push_exact
from counters.write.fallback import write_direct

logger = logging.getLogger(__name__)


def settle_fallbacks(buffer: Buffer, using: str = DEFAULT_DB_ALIAS, limit: int = 500) -> int:
    """Fence the pushes of direct writes that may still arrive; undo any that did.

    The writer of such a push was retired with it, so the push is its last:
    fencing compares it with the writer's high-water mark in each shard. Below
    it, the push is marked so that it can never apply; at it, the push did
    apply, the same deltas were counted by the direct write too, and a
    compensating push (idempotent: a derived id, :meth:`PushId.undo`) takes
    them back. Returns the number of compensated writes.
    """

    compensated = 0
    rows = FlushBatch.objects.using(using).filter(
        kind=FlushBatch.Kind.FALLBACK, unsettled__isnull=False
    )
    for row in rows.order_by("applied_at")[:limit]:
        push_id = row.batch_id.removeprefix(FALLBACK_PREFIX)
        deltas: dict[str, int] = row.unsettled or {}
        landed = buffer.fence(deltas, push_id)
        if landed:
            undo = {m: -d for m, d in deltas.items() if buffer.shard_of(m) in landed}
            if not take_back(buffer, undo, PushId.of(push_id).undo(), using):
                continue  # the DB refused the take-back: the next flush tries again
            compensated += 1
            logger.warning(
                "push %s timed out but reached Redis later; took back its %s deltas",
                push_id,
                len(undo),
            )
        age_ms = (timezone.now() - row.applied_at).total_seconds() * 1000
        if age_ms > PUSH_MARKER_TTL_MS:
            logger.warning(
                "direct write %s was fenced %.0fs late; if its push arrived meanwhile it is "
                "counted twice: run a rebuild",
                row.batch_id,
                age_ms / 1000,
            )
        FlushBatch.objects.using(using).filter(pk=row.pk).update(unsettled=None)
        metrics.late_push_settled(using, taken_back=bool(landed))
    return compensated


def take_back(buffer: Buffer, undo: dict[str, int], undo_id: PushId | str, using: str) -> bool:
    """Push ``undo`` once (id ``undo_id``); what Redis does not take goes to the DB directly.

    Redis refuses a member whose pending sum would reach 2**53, and every
    push when it is at maxmemory. The push id is then fenced where it did not
    apply, and those members are written to the DB as a settled direct write
    (id ``fallback-<undo_id>``): taking back in the DB what the late push
    added in Redis nets out the same once the flush applies it. Safe to
    repeat. Returns False if the direct write failed (it is logged; the
    caller tries again later).
    """

    undo_id = PushId.of(undo_id)
    batch_id = f"{FALLBACK_PREFIX}{undo_id}"
    ledger = FlushBatch.objects.using(using)
    if ledger.filter(pk=batch_id).exists():
        return True  # taken back in the DB already: pushing it now would take it twice
    rest, direct = dict(undo), dict[str, int]()
    try:
        push_exact(buffer, rest, direct, undo_id)
    except (RedisConnectionError, RedisTimeoutError):
        raise
    except (RedisError, StalePush) as exc:  # Redis at maxmemory refuses pushes
        logger.info("Redis refused a take-back push (%s); writing it to the DB", exc)
    # Shards where the push did not apply (refused now, or fenced by an earlier
    # attempt whose direct write failed) take it back in the DB.
    landed = buffer.fence(rest, undo_id)
    direct.update({m: d for m, d in rest.items() if buffer.shard_of(m) not in landed})
    if not direct:
        return True
    write_direct(direct, using, push_id=undo_id)
    return ledger.filter(pk=batch_id).exists()
