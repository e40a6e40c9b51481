"""Every repair is fenced: a repairer that stalled past its lease changes nothing.

The fence itself: tokens in the database, checked under a row lock by each
repair. Then a rebuild (or an audit) stalls between confirming a drift and
repairing it, its lease expires, and another repairer takes the lease and
repairs the same keys. When the stalled one resumes, the fencing token its
repair transaction checks is no longer the newest: it repairs nothing, and
says so. Each key is repaired once: truth == get_value == stored after a
flush, the truth counted in SQL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError

import counters
from counters.base import exceptions
from counters.base.exceptions import RepairFenced
from counters.client import get_buffer
from counters.flushing import fence
from counters.models import AuditRepair, RepairFence
from counters.verify import audit, hold, rebuild
from counters.verify.audit import audit as run_audit
from counters.verify.rebuild import rebuild_lease
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]


# -- the fence's tokens ----------------------------------------------------------------


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
    buffer = get_buffer()
    lease = rebuild_lease(buffer)
    assert lease.fence is None
    with lease:
        assert lease.held and lease.fence is not None
        first = lease.fence
        assert lease.acquire() and lease.fence == first  # renewed: the same token
        buffer.client.delete(lease.key)  # expired
        assert lease.acquire()
        assert lease.fence.token == first.token + 1
    other = rebuild_lease(buffer)
    with other:
        assert other.fence is not None and other.fence.token == first.token + 2
        with lease:
            assert not lease.held  # held by the other: no token taken
        assert RepairFence.objects.get(prefix=buffer.prefix).token == other.fence.token


# -- repairers stalled past their lease ------------------------------------------------


QUICK = 0.02  # seconds between confirming readings
KEYS = 10
UNREAD = 3
DRIFT = -2  # raw SQL: each stored count 1, truth 3


def values(users) -> list[tuple[int, int, int, int]]:
    """(user, truth, get_value, stored) of each user."""
    return [(u.pk, truth(u), counters.get_value("unread", u.pk), stored(u)) for u in users]


def exact(users) -> list[tuple[int, int, int, int]]:
    return [(u.pk, truth(u), truth(u), truth(u)) for u in users]


def add_to_rows(users, amount: int) -> None:
    """Raw SQL drift: ``amount`` added to each user's stored counter behind Tally's back."""
    table = connection.ops.quote_name(UnreadCounter._meta.db_table)
    with connection.cursor() as cursor:
        for user in users:
            cursor.execute(
                f"UPDATE {table} SET count = count + %s WHERE user_id = %s", [amount, user.pk]
            )


@pytest.fixture
def drifted(make_user, settings, monkeypatch) -> list:
    """KEYS users with UNREAD unread each, flushed, then their rows drifted by DRIFT.

    Leases are short (the rebuild lease lives about 1.2 s) and so are the
    confirmation delays, so that a stall outlives a lease quickly.
    """
    settings.COUNTERS_LEASE_TIMEOUT = 1
    monkeypatch.setattr(rebuild, "default_confirm_delay", lambda: QUICK)
    monkeypatch.setattr(hold, "default_confirm_delay", lambda: QUICK)  # the lease's length
    users = [make_user() for _ in range(KEYS)]
    for _ in range(UNREAD):
        Notification.objects.notify(users, verb="v")
    counters.flush()
    add_to_rows(users, DRIFT)
    assert [stored(u) for u in users] == [UNREAD + DRIFT] * KEYS
    return users


class Stall:
    """Wraps ``confirm_drifts`` of ``module``: its first repair waits until ``resume`` is set."""

    def __init__(self, monkeypatch, module: Any) -> None:
        self.stalled = threading.Event()
        self.resume = threading.Event()
        real = module.confirm_drifts

        def confirm_drifts(*args: Any, repair: Callable | None = None, **kwargs: Any) -> Any:
            def stalled_repair(confirmed: dict) -> None:
                if not self.stalled.is_set():
                    self.stalled.set()
                    assert self.resume.wait(60)
                assert repair is not None
                repair(confirmed)

            return real(*args, repair=None if repair is None else stalled_repair, **kwargs)

        monkeypatch.setattr(module, "confirm_drifts", confirm_drifts)


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list]:
    """Run ``target`` in a thread; the list gets its result or the exception it raised."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:
            outcome.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def wait_until_lease_expires(stall: Stall) -> None:
    assert stall.stalled.wait(30), "the repairer never reached its repair"
    buffer = get_buffer()
    deadline = time.monotonic() + 10
    while buffer.client.exists(f"{buffer.prefix}:rebuild"):
        assert time.monotonic() < deadline, "the lease did not expire"
        time.sleep(0.02)


@pytest.fixture
def threads() -> Iterator[list[threading.Thread]]:
    started: list[threading.Thread] = []
    yield started
    for thread in started:
        thread.join(60)


def test_a_rebuild_stalled_past_its_lease_repairs_nothing_after_the_audit(
    drifted, monkeypatch, threads
):
    users = drifted
    stall = Stall(monkeypatch, rebuild)
    thread, outcome = in_thread(lambda: rebuild.rebuild_all(batch_size=100))
    threads.append(thread)
    wait_until_lease_expires(stall)
    result = run_audit(names=["unread"], confirm_delay=QUICK)
    assert (result.repaired, result.stopped) == (KEYS, None)
    counters.flush()
    assert values(users) == exact(users)
    stall.resume.set()
    thread.join(60)
    counters.flush()
    assert values(users) == exact(users)
    assert AuditRepair.objects.count() == KEYS
    [raised] = outcome
    assert isinstance(raised, exceptions.RepairFenced), raised
    assert "nothing was changed" in str(raised)
    # The full rebuild did not complete: a new one runs, and finds nothing to repair.
    reports = rebuild.rebuild_all(batch_size=100)
    assert sum(r.repaired for r in reports) == 0
    counters.flush()
    assert values(users) == exact(users)


def test_an_audit_stalled_past_its_lease_repairs_nothing_after_the_rebuild(
    drifted, monkeypatch, threads
):
    users = drifted
    stall = Stall(monkeypatch, audit)
    thread, outcome = in_thread(lambda: run_audit(names=["unread"], confirm_delay=QUICK))
    threads.append(thread)
    wait_until_lease_expires(stall)
    report = rebuild.rebuild("unread", confirm_delay=QUICK)
    assert report.repaired == KEYS
    counters.flush()
    assert values(users) == exact(users)
    stall.resume.set()
    thread.join(60)
    counters.flush()
    assert values(users) == exact(users)
    assert not AuditRepair.objects.exists()
    [result] = outcome
    assert result.repaired == 0
    assert result.stopped is not None and "was lost" in result.stopped


def test_a_rebuild_command_stalled_past_its_lease_repairs_nothing_after_the_audit(
    drifted, monkeypatch, threads
):
    """``counters_rebuild NAME`` holds the lease and passes its fence to each rebuild."""
    from django.core.management import CommandError, call_command

    users = drifted
    stall = Stall(monkeypatch, rebuild)
    thread, outcome = in_thread(lambda: call_command("counters_rebuild", "unread"))
    threads.append(thread)
    wait_until_lease_expires(stall)
    assert run_audit(names=["unread"], confirm_delay=QUICK).repaired == KEYS
    stall.resume.set()
    thread.join(60)
    counters.flush()
    assert values(users) == exact(users)
    [raised] = outcome
    assert isinstance(raised, CommandError), raised
    assert "repair refused" in str(raised)


def test_a_retry_that_lost_its_fence_puts_nothing_back(drifted, monkeypatch):
    """A retry of the quarantine whose fence a newer repairer took raises and changes nothing."""
    from counters.flushing import fence
    from counters.ops import run as flushing

    users = drifted
    buffer = get_buffer()
    buffer.push({"unread:abc": 2}, "poison")  # a key its field cannot hold
    assert counters.flush().quarantined == 1
    real = flushing.quarantine.fenced

    def taken_over(held: fence.Fence) -> Any:
        fence.take(held.prefix, held.using)  # another repairer took the lease meanwhile
        return real(held)

    monkeypatch.setattr(flushing.quarantine, "fenced", taken_over)
    for option in ("retry_quarantined", "discard_quarantined"):
        with pytest.raises(exceptions.RebuildRunning):
            counters.flush(**{option: True})
        assert [(e.member, e.delta) for e in buffer.quarantined()] == [("unread:abc", 2)]
    monkeypatch.setattr(flushing.quarantine, "fenced", real)
    assert counters.flush(discard_quarantined=True).discarded == 1
    add_to_rows(users, -DRIFT)
    assert values(users) == exact(users)
