"""A counter keyed by several columns: notifications per recipient and local day, exact
against SQL COUNT grouped by the same parts through every path, a random mix and a rebuild."""

from __future__ import annotations

import datetime
import io
import random
import zoneinfo
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connection
from django.db.models import Count, Q
from django.db.models.functions import TruncDate
from django.utils import timezone

import counters
from counters.base import registry
from counters.base.exceptions import InvalidKey, TrackingError
from counters.base.keys import CompositeKey
from counters.tracking import trackers
from counters.tracking.refusals import problems
from counters.write.upserts import composite
from notifications.models import DailyCount, Notification

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

NAME = "daily_notifications"
#: Far from UTC, so a notification's local day often differs from its UTC day.
AUCKLAND = zoneinfo.ZoneInfo("Pacific/Auckland")
#: The current time zone of the test: Auckland, or UTC on a MySQL without its zone tables.
ZONE = AUCKLAND


@pytest.fixture(autouse=True)
def daily(monkeypatch) -> Iterator[None]:
    """The composite counter, declared for this test alone, in a time zone far from UTC
    (UTC on a MySQL or MariaDB without its time zone tables, which cannot convert)."""
    global ZONE
    ZONE = AUCKLAND if zone_tables() else zoneinfo.ZoneInfo("UTC")
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    for name in ("_trackers", "_by_model", "_tracked_fields", "_attnames", "_names"):
        monkeypatch.setattr(trackers, name, dict(getattr(trackers, name)))
    counters.track(
        NAME,
        Notification,
        key=("recipient", "created_at__date"),
        into="notifications.DailyCount.count",
    )
    with timezone.override(ZONE):
        yield


def zone_tables() -> bool:
    """Whether the database converts to named time zones (MySQL needs its zone tables)."""
    if connection.vendor != "mysql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT CONVERT_TZ('2000-01-01 00:00:00', 'UTC', %s)", [str(AUCKLAND)])
        return cursor.fetchone()[0] is not None


def python_truth() -> dict[tuple, int]:
    """The same truth grouped in Python by ``timezone.localtime(created_at).date()``."""
    rows = Notification.objects.values_list("recipient", "created_at")
    return dict(Counter((r, local_day(moment)) for r, moment in rows))


def truth() -> dict[tuple, int]:
    """SQL COUNT of notifications grouped by recipient and local day: the ground truth."""
    rows = (
        Notification.objects.annotate(day=TruncDate("created_at", tzinfo=ZONE))
        .order_by()
        .values("recipient", "day")
        .annotate(n=Count("id"))
        .values_list("recipient", "day", "n")
    )
    return {(r, day): n for r, day, n in rows}


def stored() -> dict[tuple, int]:
    rows = DailyCount.objects.values_list("recipient_id", "created_at_date", "count")
    return {(r, day): n for r, day, n in rows if n}


def exact_values(keys) -> dict[tuple, int]:
    values = counters.get_values(NAME, list(keys))
    return {k: v for k, v in values.items() if v}


def assert_exact(extra_keys=()) -> None:
    """Reads equal the truth now; after a flush the rows do too."""
    expected = truth()
    keys = set(expected) | set(stored()) | set(extra_keys)
    assert exact_values(keys) == expected
    counters.flush()
    assert stored() == expected
    assert exact_values(keys) == expected


def at(day: int, hour: int, minute: int = 0) -> datetime.datetime:
    """A UTC time in November 2026: 11:00 UTC is midnight in Auckland (UTC+13)."""
    return datetime.datetime(2026, 11, day, hour, minute, tzinfo=datetime.UTC)


def local_day(moment: datetime.datetime) -> datetime.date:
    return timezone.localtime(moment, ZONE).date()


@pytest.mark.usefixtures("redis_backend")
def test_every_path_counts_each_local_day_exactly(make_user):
    alice, bob = make_user(), make_user()
    first = Notification.objects.create(recipient=alice, verb="a", created_at=at(24, 10, 59))
    Notification.objects.create(recipient=alice, verb="b", created_at=at(24, 11, 0))
    day = local_day(at(24, 11, 0))
    assert day == datetime.date(2026, 11, 25 if ZONE is AUCKLAND else 24)
    assert counters.get_value(NAME, (alice.pk, day)) == (1 if ZONE is AUCKLAND else 2)
    assert_exact()
    Notification.objects.bulk_create(
        [
            Notification(recipient=u, verb="bulk", created_at=at(25, h))
            for u in (alice, bob)
            for h in (1, 12, 23)
        ]
    )
    assert_exact()
    first.created_at = at(25, 12)  # save() moving a row to another day
    first.save()
    Notification.objects.filter(recipient=bob, created_at__gte=at(25, 12)).update(
        created_at=at(20, 3)
    )
    assert_exact()
    stale = Notification.objects.filter(recipient=bob).first()
    assert stale is not None
    Notification.objects.filter(pk=stale.pk).update(created_at=at(26, 0))
    stale.save()  # a stale instance puts the old day back: counted from the locked row
    assert_exact()
    rows = list(Notification.objects.filter(recipient=alice)[:2])
    for row in rows:
        row.created_at = at(27, 5)
    Notification.objects.bulk_update(rows, ["created_at"])
    Notification.objects.filter(recipient=alice, verb="b").delete()
    rows[0].delete()
    assert_exact()
    Notification.objects.filter(recipient=alice).mark_all_read()  # reading moves no day
    keys = set(truth())
    bob_keys = {k for k in keys if k[0] == bob.pk}
    bob.delete()  # a cascade: its rows and its counter rows go; buffered deltas are dropped
    assert_exact(bob_keys)
    assert not DailyCount.objects.filter(recipient_id=bob_keys.pop()[0]).exists()


@pytest.fixture(params=["native", "generic"], ids=["native-upsert", "generic"])
def applier(request, monkeypatch) -> str:
    """The database's own upsert, then the ORM path of other databases."""
    if request.param == "generic":
        monkeypatch.setattr(composite, "NATIVE", ())
    return request.param


@pytest.mark.usefixtures("applier")
def test_a_seeded_random_mix_stays_exact(make_user):
    rng = random.Random(2511)
    users = [make_user() for _ in range(4)]
    for step in range(150):
        op = rng.random()
        user = rng.choice(users)
        moment = at(rng.randint(20, 23), rng.randint(0, 23), rng.randint(0, 59))
        if op < 0.35:
            Notification.objects.create(recipient=user, verb=str(step), created_at=moment)
        elif op < 0.5:
            Notification.objects.bulk_create(
                [Notification(recipient=user, verb=str(step), created_at=moment)] * 3
            )
        elif op < 0.65:
            Notification.objects.filter(recipient=user, id__gt=rng.randint(0, 10**4)).update(
                created_at=moment
            )
        elif op < 0.75:
            row = Notification.objects.filter(recipient=user).order_by("?").first()
            if row is not None:
                row.created_at = moment
                row.recipient = rng.choice(users)
                row.save()
        elif op < 0.9:
            ids = list(Notification.objects.filter(recipient=user).values_list("id", flat=True))
            Notification.objects.filter(id__in=rng.sample(ids, min(len(ids), 2))).delete()
        else:
            counters.flush()
    assert truth() == python_truth()
    assert_exact()


def test_rebuild_puts_back_the_sql_truth(make_user):
    users = [make_user() for _ in range(3)]
    for i, user in enumerate(users):
        Notification.objects.bulk_create(
            [
                Notification(recipient=user, verb="v", created_at=at(22 + j % 3, 7 * j % 24))
                for j in range(4 + i)
            ]
        )
    counters.flush()
    expected = truth()
    DailyCount.objects.filter(recipient=users[0]).update(count=99)
    DailyCount.objects.filter(recipient=users[1]).delete()
    DailyCount.objects.create(
        recipient=users[2], created_at_date=datetime.date(2026, 1, 1), count=5
    )
    assert stored() != expected
    report = counters.rebuild(NAME, batch_size=4, confirm_delay=0.05)
    assert report.repaired >= 3
    counters.flush()
    assert stored() == expected
    assert exact_values(set(expected) | {(users[2].pk, datetime.date(2026, 1, 1))}) == expected


def test_keys_are_tuples_or_their_text(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v", created_at=at(25, 1))
    day = datetime.date(2026, 11, 25)
    spec = counters.get_spec(NAME)
    key = spec.normalize((str(alice.pk), "2026-11-25"))
    assert key == (alice.pk, day) and isinstance(key, CompositeKey)
    assert spec.member(key) == f'{NAME}:[{alice.pk},"2026-11-25"]'
    assert spec.normalize(str(key)) == key  # the member's text gives the key back
    for form in ((alice.pk, day), (alice.pk, "2026-11-25"), str(key)):
        assert counters.get_value(NAME, form) == 1
    counters.flush()
    assert counters.get_values(NAME, [(alice.pk, day), (alice.pk, day.replace(day=1))]) == {
        (alice.pk, day): 1,
        (alice.pk, day.replace(day=1)): 0,
    }
    for wrong in (alice.pk, (alice.pk,), (alice.pk, day, 1), (None, day), (alice.pk, "soon")):
        with pytest.raises(InvalidKey):
            counters.get_value(NAME, wrong)


def test_without_zone_tables_the_truth_is_refused_clearly(make_user):
    if zone_tables():
        pytest.skip("the database has its time zone tables")
    Notification.objects.create(recipient=make_user(), verb="v", created_at=at(25, 1))
    with timezone.override(AUCKLAND), pytest.raises(ImproperlyConfigured, match="zone tables"):
        counters.rebuild(NAME, confirm_delay=0.05)


def test_status_and_audit_read_composite_counters(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v", created_at=at(25, 1))
    assert problems(trackers.get_tracker(NAME)) == []  # what manage.py check runs
    out = io.StringIO()
    call_command("counters_status", stdout=out)
    counters.flush()
    DailyCount.objects.update(count=7)  # drift the audit finds and repairs
    for _ in range(3):
        counters.audit(confirm_delay=0.05)
    counters.flush()
    assert stored() == truth()


def test_applied_signal_carries_composite_keys(make_user):
    alice = make_user()
    got: list[dict[Any, int]] = []

    def receiver(sender, counter, deltas, using, **kwargs):
        if counter == NAME:
            got.append(deltas)

    counters.signals.applied.connect(receiver, weak=False)
    try:
        Notification.objects.create(recipient=alice, verb="v", created_at=at(25, 1))
        counters.flush()
    finally:
        counters.signals.applied.disconnect(receiver)
    assert got == [{(alice.pk, datetime.date(2026, 11, 25)): 1}]


@pytest.mark.parametrize(
    ("key", "into", "says"),
    [
        (("recipient", "created_at"), "notifications.DailyCount.count", "add __date"),
        (("recipient", "verb__upper"), "notifications.DailyCount.count", "relations are not"),
        (("recipient", "is_read__date"), "notifications.DailyCount.count", "applies to a Date"),
        (("recipient", "created_at__date"), "notifications.UnreadCounter.count", "no field"),
        (("verb", "created_at__date"), "notifications.DailyCount.count", "no field 'verb'"),
        (("recipient",), "notifications.DailyCount.count", "two or more"),
    ],
)
def test_what_cannot_be_stored_is_refused(key, into, says):
    with pytest.raises(TrackingError) as info:
        counters.track("daily_refused", Notification, key=key, into=into)
    assert info.value.check_id == "counters.E055"
    assert says in str(info.value)


def test_a_where_through_a_relation_is_refused_with_a_composite_key():
    with pytest.raises(TrackingError) as info:
        counters.track(
            "daily_refused",
            Notification,
            key=("recipient", "created_at__date"),
            into="notifications.DailyCount.count",
            where=Q(recipient__is_active=True),
        )
    assert info.value.check_id in {"counters.E055", "counters.E056"}
    assert "daily_refused" not in {spec.name for spec in registry.all_specs()}
