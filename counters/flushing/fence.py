"""One fence for every repair: a token issued by the database, checked by the repair's transaction.

A repair changes what a counter is worth without a change of its truth: the
audit's and the rebuild's ``truth - exact`` deltas, and putting quarantined
deltas back or away. Two repairers acting on one reading would repair twice,
so they hold the rebuild lease of their key prefix. A Redis lease has a TTL:
a repairer that stalls (a GC pause, a stopped VM, a slow query) past it can
wake up after another one took the lease and repaired, and act on its old
reading. The fence stops it.

Invariant: a repair commits only if no repairer of its prefix took a token
after it. Each repairer takes the next token from the prefix's
:class:`~counters.models.RepairFence` row when it takes the lease
(:class:`RepairLease`), in a transaction of its own, before its first
reading. Each repair runs in a transaction (:func:`fenced`) whose first
statement is ``UPDATE ... WHERE prefix = %s AND token = <its token>``: the
row stays locked until that transaction ends, so a newer token is either
issued before (the update matches nothing: :class:`RepairFenced`, and
nothing is changed) or after the repair has committed (and the newer
repairer's readings, taken after its token, see the repair). Deltas added
in that transaction leave for Redis only after its COMMIT, like every
change; a Redis step of a repair (the quarantine's) runs while the row is
locked.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.models import F, QuerySet
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from counters.base.exceptions import RepairFenced
from counters.buffer.cluster import Client
from counters.buffer.lease import Lease
from counters.models import RepairFence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fence:
    """Token ``token`` of the repairs of key prefix ``prefix`` in database ``using``."""

    prefix: str
    token: int
    using: str


def take(prefix: str, using: str) -> Fence:
    """Issue the next token of ``prefix``: every older one is refused from now on.

    Committed at once when called outside a transaction (as repairers do);
    it waits for a repair of an older token that is committing.
    """

    rows = RepairFence.objects.using(using).filter(prefix=prefix)
    with transaction.atomic(using=using):
        if not _bump(rows):
            try:
                with transaction.atomic(using=using):
                    RepairFence.objects.using(using).create(prefix=prefix, token=1)
            except IntegrityError:  # created meanwhile by another repairer
                _bump(rows)
        token = rows.values_list("token", flat=True).get()
    logger.debug("repair fence of prefix %r: token %s taken", prefix, token)
    return Fence(prefix, int(token), using)


def _bump(rows: QuerySet[Any]) -> int:
    return int(rows.update(token=F("token") + 1, issued_at=timezone.now()))


def check(fence: Fence) -> None:
    """Lock the fence row until the current transaction ends; raise if ``fence`` is stale.

    Call first in the transaction of a repair. Raises :class:`RepairFenced`
    when a newer token was issued: the transaction must roll back.
    """

    if not connections[fence.using].in_atomic_block:
        raise TransactionManagementError("check a repair fence inside the repair's transaction")
    rows = RepairFence.objects.using(fence.using).filter(prefix=fence.prefix, token=fence.token)
    if rows.update(token=fence.token) != 1:
        logger.warning(
            "repair of prefix %r with fencing token %s refused: a newer repairer took over",
            fence.prefix,
            fence.token,
        )
        raise RepairFenced(fence.prefix, fence.token)


@contextmanager
def fenced(fence: Fence) -> Iterator[None]:
    """``with fenced(fence):`` a transaction that applies a repair only if ``fence`` still holds."""
    with transaction.atomic(using=fence.using):
        check(fence)
        yield


class RepairLease(Lease):
    """The rebuild lease of a key prefix; each time it is taken anew, a new fencing token.

    ``fence`` is the token of the current holding (None before the first).
    Renewing a lease still held keeps the token; taking it again after it
    was lost takes a new one. Take it before the first reading, and only
    then: a holder that lost it mid-work must not take it again and go on
    with readings from before (its new token would hide them).
    """

    def __init__(self, client: Client, key: str, ttl: float, *, prefix: str, using: str) -> None:
        super().__init__(client, key, ttl)
        self.prefix = prefix
        self.using = using
        self.fence: Fence | None = None

    def __enter__(self) -> RepairLease:
        self.acquire()
        return self

    def acquire(self) -> bool:
        if self.held and self.extend():
            return True
        if not super().acquire():
            return False
        try:
            self.fence = take(self.prefix, self.using)
        except BaseException:
            self.release()  # no token, no repairs: let another repairer have it
            raise
        return True
