"""The repair fence itself: tokens in the database, checked under a row lock by each repair."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError

from counters import api, fence
from counters.exceptions import RepairFenced
from counters.models import AuditRepair, RepairFence

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]


def record(key: str) -> None:
    AuditRepair.objects.create(counter="unread", key=key, stored=0, buffered=0, truth=1)


def test_tokens_rise_per_prefix():
    first = fence.take("a", "default")
    assert [first.token, fence.take("a", "default").token] == [1, 2]
    assert fence.take("b", "default").token == 1
    assert dict(RepairFence.objects.values_list("prefix", "token")) == {"a": 2, "b": 1}


def test_only_the_newest_token_repairs_and_a_stale_one_changes_nothing():
    old = fence.take("p", "default")
    new = fence.take("p", "default")
    with pytest.raises(RepairFenced) as info, fence.fenced(old):
        record("stale")
    assert (info.value.prefix, info.value.token) == ("p", old.token)
    with fence.fenced(new):
        record("fresh")
    assert list(AuditRepair.objects.values_list("key", flat=True)) == ["fresh"]
    assert RepairFence.objects.get(prefix="p").token == new.token


def test_the_check_belongs_inside_the_repair_transaction():
    held = fence.take("p", "default")
    with pytest.raises(TransactionManagementError):
        fence.check(held)
    with transaction.atomic():
        fence.check(held)


def test_a_new_token_waits_for_a_repair_that_is_committing():
    """The check locks the row: a newer token is issued only after the repair committed."""
    held = fence.take("p", "default")
    in_repair, taken = threading.Event(), []

    def newer() -> None:
        try:
            assert in_repair.wait(10)
            taken.append(fence.take("p", "default"))
        finally:
            connection.close()

    thread = threading.Thread(target=newer)
    thread.start()
    try:
        with fence.fenced(held):
            record("k")
            in_repair.set()
            time.sleep(0.5)
            assert taken == []  # still waiting for this transaction
    finally:
        thread.join(30)
    [newer_fence] = taken
    assert newer_fence.token == held.token + 1
    assert AuditRepair.objects.count() == 1
    with pytest.raises(RepairFenced), fence.fenced(held):
        record("after")
    assert AuditRepair.objects.count() == 1


def test_the_rebuild_lease_takes_a_token_each_time_it_is_taken_anew():
    buffer = api.get_buffer()
    lease = api.rebuild_lease(buffer)
    assert lease.fence is None
    with lease:
        assert lease.held and lease.fence is not None
        first = lease.fence
        assert lease.acquire() and lease.fence == first  # renewed: the same token
        buffer.client.delete(lease.key)  # expired
        assert lease.acquire()
        assert lease.fence.token == first.token + 1
    other = api.rebuild_lease(buffer)
    with other:
        assert other.fence is not None and other.fence.token == first.token + 2
        with lease:
            assert not lease.held  # held by the other: no token taken
        assert RepairFence.objects.get(prefix=buffer.prefix).token == other.fence.token
