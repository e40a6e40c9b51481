"""Quarantined deltas are part of the exact value until they are discarded.

A flush that cannot apply some deltas quarantines them. Reads, the audit and
the rebuild all count them (as buffered), so neither the audit nor the
rebuild "repairs" them, and a retry that then applies them, or a discard
that drops them, never counts them twice: truth == get_value == stored after
a flush, with the truth counted in SQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest

import counters
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.models import AuditRepair
from counters.read.values import get_parts
from counters.verify.audit import audit
from counters.verify.rebuild import rebuild
from counters.write.apply import apply_deltas
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.usefixtures("redis_backend"),
]

QUICK = 0.02  # seconds between confirming readings: nothing else writes in these tests
USERS = 100
UNREAD = 3  # notifications per user: 300 deltas quarantined in all


def get_value(user) -> int:
    return counters.get_value("unread", user.pk)


def values(users) -> list[tuple[int, int, int, int]]:
    """(user, truth, get_value, stored) of each user."""
    return [(u.pk, truth(u), get_value(u), stored(u)) for u in users]


def exact(users) -> list[tuple[int, int, int, int]]:
    """What ``values`` is when every counter is right: the SQL truth three times."""
    return [(u.pk, truth(u), truth(u), truth(u)) for u in users]


@pytest.fixture
def quarantined(make_user) -> Iterator[list]:
    """USERS users with UNREAD unread notifications each, whose deltas the flush quarantined.

    The fault (every batch holding one of their members fails) is injected
    only for that flush: once it is gone, a retry applies them.
    """
    users = [make_user() for _ in range(USERS)]
    for _ in range(UNREAD):
        Notification.objects.notify(users, verb="v")
    poisoned = {f"unread:{u.pk}" for u in users}

    def failing(items, using):  # type: ignore[no-untyped-def]
        if poisoned & set(items):
            raise ValueError("injected: this batch cannot be applied")
        return apply_deltas(items, using)

    with mock.patch.object(flusher, "apply_deltas", failing):
        result = counters.flush()
    assert result.quarantined == USERS
    entries = get_buffer().quarantined()
    assert sum(e.delta for e in entries) == USERS * UNREAD
    assert not UnreadCounter.objects.filter(user__in=users).exists()
    return users


def test_reads_count_quarantined_deltas(quarantined):
    users = quarantined
    assert [(pk, t, v) for pk, t, v, _ in values(users)] == [(u.pk, UNREAD, UNREAD) for u in users]
    assert get_parts("unread", [users[0].pk]) == {users[0].pk: (0, UNREAD)}


def test_the_audit_does_not_repair_them_and_a_retry_counts_them_once(quarantined):
    users = quarantined
    result = audit(names=["unread"], confirm_delay=QUICK)
    assert (result.checked, result.repaired, result.unstable) == (USERS, 0, 0)
    assert not AuditRepair.objects.exists()
    retried = counters.flush(retry_quarantined=True)
    assert (retried.requeued, retried.quarantined) == (USERS, 0)
    assert get_buffer().quarantined() == []
    assert values(users) == exact(users)
    assert sum(truth(u) for u in users) == USERS * UNREAD
    # Nothing left for an audit or a flush to change.
    assert audit(names=["unread"], confirm_delay=QUICK).repaired == 0
    counters.flush()
    assert values(users) == exact(users)


def test_the_rebuild_does_not_repair_them_and_a_retry_counts_them_once(quarantined):
    users = quarantined
    report = rebuild("unread", confirm_delay=QUICK)
    assert (report.checked, report.repaired, report.wrong) == (USERS, 0, [])
    counters.flush(retry_quarantined=True)
    assert values(users) == exact(users)


def test_a_discard_drops_them_once_and_the_audit_gives_the_count_back(quarantined):
    users = quarantined
    discarded = counters.flush(discard_quarantined=True)
    assert discarded.discarded == USERS
    assert get_buffer().quarantined() == []
    # Dropped for good: the value loses them, and the truth still has them.
    assert [(pk, t, v) for pk, t, v, _ in values(users)] == [(u.pk, UNREAD, 0) for u in users]
    result = audit(names=["unread"], confirm_delay=QUICK)
    assert result.repaired == USERS
    counters.flush()
    assert values(users) == exact(users)
    # A second discard or retry finds nothing to drop or put back.
    again = counters.flush(discard_quarantined=True)
    assert again.discarded == 0
    assert counters.flush(retry_quarantined=True).requeued == 0
    assert values(users) == exact(users)


def test_a_change_after_the_quarantine_adds_to_it(quarantined):
    users = quarantined
    Notification.objects.filter(recipient=users[0]).first().mark_read()
    Notification.objects.create(recipient=users[1], verb="more")
    counters.flush()
    assert values(users[:2]) == [
        (users[0].pk, UNREAD - 1, UNREAD - 1, -1),
        (users[1].pk, UNREAD + 1, UNREAD + 1, 1),
    ]
    assert audit(names=["unread"], confirm_delay=QUICK).repaired == 0
    counters.flush(retry_quarantined=True)
    assert values(users) == exact(users)
