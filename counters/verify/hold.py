"""The rebuild lease: one repairer of a key prefix at a time, and an audit's mark on it.

Two repairers confirming the same drift at once would both repair it, so a
full rebuild, a repair of keys read below zero, a retry or discard of the
quarantine and an audit run each hold the rebuild lease of the key prefix
(:func:`rebuild_lease`), and their repairs check its fencing token
(:mod:`counters.flushing.fence`). An audit run holds it for a moment every few
seconds, with a mark (:class:`AuditHold`) that lets a rebuild wait for the
run to end (:func:`wait_for_audit`) instead of failing.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from redis import RedisError

from counters.base import conf
from counters.base.utils import to_str
from counters.buffer.lease import Lease
from counters.buffer.store import Buffer
from counters.flushing.fence import Fence, RepairLease
from counters.verify.drift import CONFIRM_ROUNDS, default_confirm_delay


def rebuild_lease(buffer: Buffer, using: str = DEFAULT_DB_ALIAS) -> RepairLease:
    """The lease that keeps full rebuilds, repairs and audits of one prefix from overlapping.

    Two of them confirming the same drift at once would both repair it. The
    lease outlives one page of a rebuild (its confirmation rounds included)
    and is extended after each page. Taking it takes a fencing token in
    database ``using`` (``lease.fence``), which the holder's repairs check:
    a holder that outlived its lease repairs nothing.
    """
    page = CONFIRM_ROUNDS * default_confirm_delay()
    return RepairLease(
        buffer.client,
        f"{buffer.prefix}:rebuild",
        conf.lease_timeout() + page,
        prefix=buffer.prefix,
        using=using,
    )


def audit_holder_key(buffer: Buffer) -> str:
    """Holds the rebuild lease's token while an audit run holds that lease."""
    return f"{buffer.prefix}:rebuild:audit"


def wait_for_audit(buffer: Buffer, lease: Lease) -> bool:
    """Take ``lease`` once the audit run that holds it ends; False if something else holds it.

    An audit run holds the rebuild lease for a moment every few seconds: a
    rebuild that starts meanwhile waits for it (at most one lease time)
    instead of failing.
    """
    deadline = time.monotonic() + lease.ttl_ms / 1000
    while time.monotonic() < deadline:
        if lease.acquire():
            return True
        holder = buffer.client.get(lease.key)
        if holder is not None and holder != buffer.client.get(audit_holder_key(buffer)):
            return False  # a rebuild or a repair holds it
        time.sleep(0.05)
    return lease.acquire()


class LeaseLost(Exception):
    """The rebuild lease expired during a run: stop before another run overlaps this one."""


class AuditHold:
    """The rebuild lease, held by an audit run, and the mark that says an audit holds it.

    A rebuild that finds the lease taken by an audit waits for the run to end
    (:func:`wait_for_audit`) instead of failing. The mark is removed only
    after the lease is released, so such a rebuild never sees the lease held
    without it.
    """

    def __init__(self, buffer: Buffer, using: str) -> None:
        self.lease = rebuild_lease(buffer, using)
        self.client = buffer.client
        self.mark = audit_holder_key(buffer)

    def __enter__(self) -> AuditHold:
        if self.lease.acquire():
            self.client.set(self.mark, self.lease.token, px=self.lease.ttl_ms)
        return self

    @property
    def fence(self) -> Fence:
        """The fencing token taken with the lease."""
        assert self.lease.fence is not None, "the lease is not held"
        return self.lease.fence

    def extend(self) -> None:
        """Renew the lease and the mark; raises :class:`LeaseLost` if the lease is gone."""
        if not self.lease.extend():
            raise LeaseLost
        self.client.pexpire(self.mark, self.lease.ttl_ms)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        held = self.lease.held
        self.lease.__exit__(exc_type, exc, tb)
        if held:
            try:
                if to_str(self.client.get(self.mark)) == self.lease.token:
                    self.client.delete(self.mark)
            except RedisError:
                if exc is None:
                    raise  # else it expires by itself; never mask the original error
