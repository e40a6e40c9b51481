"""Admin: notification filters, search and counted actions; counters and their rebuild action."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission
from django.db import connection

import counters
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth
from tests.web.conftest import notify

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

NOTIFICATIONS = "/admin/notifications/notification/"
COUNTERS = "/admin/notifications/unreadcounter/"


@pytest.fixture
def staff(make_member, logged_in):
    return logged_in(make_member("root", is_staff=True, is_superuser=True))


def cell(html: str, field: str, row: int = 0) -> str:
    return re.findall(rf'<td class="field-{field}[^"]*">(.*?)</td>', html, re.S)[row]


def verbs(html: str) -> list[str]:
    return re.findall(r'<td class="field-verb">(.*?)</td>', html)


def set_stored(user, value: int) -> None:
    """Corrupt a stored counter behind Tally's back, as raw SQL would."""
    table = connection.ops.quote_name(UnreadCounter._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET count = %s WHERE user_id = %s", [value, user.pk])


def test_notification_filters_and_search(staff, alice, bob):
    notify(alice, 2, verb="commented on your post")
    notify(bob, 1, verb="mentioned you", is_read=True)
    html = staff.get(NOTIFICATIONS, {"is_read__exact": "0"}).content.decode()
    assert verbs(html) == ["commented on your post"] * 2
    assert verbs(staff.get(NOTIFICATIONS, {"q": "bob"}).content.decode()) == ["mentioned you"]
    assert verbs(staff.get(NOTIFICATIONS, {"q": "mention"}).content.decode()) == ["mentioned you"]
    # The "Today" link of the created_at filter, which keeps the is_read filter.
    today = re.search(r'href="(\?created_at__gte=[^"]+)"', html)[1].replace("&amp;", "&")
    assert len(verbs(staff.get(NOTIFICATIONS + today).content.decode())) == 2


@pytest.mark.parametrize(("action", "expected"), [("mark_read", 0), ("mark_unread", 3)])
def test_mark_actions_go_through_the_counted_path(staff, alice, bob, action, expected):
    mine = notify(alice, 2) + notify(alice, 1, is_read=True)
    notify(bob, 2)
    response = staff.post(
        NOTIFICATIONS,
        {"action": action, "_selected_action": [n.pk for n in mine]},
        follow=True,
    )
    assert response.status_code == 200
    assert truth(alice) == expected
    assert truth(bob) == 2
    assert_exact(alice, bob)


def test_delete_selected_counts_the_unread_rows(staff, alice):
    unread = notify(alice, 3)
    notify(alice, 1, is_read=True)
    response = staff.post(
        NOTIFICATIONS,
        {
            "action": "delete_selected",
            "_selected_action": [unread[0].pk, unread[1].pk],
            "post": "yes",
        },
    )
    assert response.status_code == 302
    assert truth(alice) == 1
    assert_exact(alice)


def test_change_form_save_is_counted(staff, alice):
    (n,) = notify(alice, 1)
    form = {"recipient": alice.pk, "actor": "", "verb": n.verb, "description": "", "is_read": "on"}
    form.update({"created_at_0": "2026-01-01", "created_at_1": "10:00:00"})
    response = staff.post(f"{NOTIFICATIONS}{n.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert truth(alice) == 0
    assert_exact(alice)


def test_counter_list_shows_stored_pending_exact_and_truth(staff, alice):
    notify(alice, 2)
    counters.flush()
    notify(alice, 3)
    Notification.objects.filter(recipient=alice).first().mark_read()
    html = staff.get(COUNTERS).content.decode()
    parts = ("count_stored", "count_pending", "count_exact")
    assert tuple(cell(html, part) for part in parts) == ("2", "2", "4")
    assert cell(html, "count_truth") == str(truth(alice)) == "4"
    assert 'alt="True"' in cell(html, "count_in_sync")
    detail = staff.get(f"{COUNTERS}{alice.pk}/change/").content.decode()
    assert "pending (buffered)" in detail.lower()
    assert staff.get(f"{COUNTERS}add/").status_code == 403


def test_rebuild_action_repairs_drift_through_the_delta_path(staff, alice, bob):
    notify(alice, 3)
    notify(bob, 2)
    counters.flush()
    set_stored(alice, 10)
    html = staff.get(COUNTERS).content.decode()
    assert 'alt="False"' in html  # alice's row is out of sync
    selected = {"action": "rebuild_selected", "_selected_action": [alice.pk, bob.pk]}
    response = staff.post(COUNTERS, selected, follow=True)
    page = response.content.decode()
    assert f"2 counters checked; 1 repaired (unread {alice.pk}: 10 → 3)." in page
    assert UnreadCounter.objects.get_count(alice) == 3  # exact at once
    assert stored(alice) == 10  # the repair is a delta, applied by the flush
    assert_exact(alice, bob)
    response = staff.post(
        COUNTERS, {"action": "rebuild_selected", "_selected_action": [alice.pk]}, follow=True
    )
    assert "1 counter checked; all were exact." in response.content.decode()


def test_rebuild_reports_exact_before_and_truth_of_each_wrong_row(staff, alice, bob):
    notify(alice, 2)
    notify(bob, 1)
    counters.flush()
    set_stored(alice, -4)
    set_stored(bob, 3)
    response = staff.post(
        COUNTERS, {"action": "rebuild_selected", "_selected_action": [alice.pk, bob.pk]}
    )
    assert response.status_code == 302
    page = staff.get(COUNTERS).content.decode()
    assert "2 counters checked; 2 repaired (" in page
    assert f"unread {alice.pk}: -4 → 2" in page and f"unread {bob.pk}: 3 → 1" in page
    assert_exact(alice, bob)


def test_rebuild_needs_the_change_permission(make_member, logged_in, alice):
    viewer = make_member("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_unreadcounter"))
    notify(alice, 1)
    counters.flush()
    client = logged_in(viewer)
    html = client.get(COUNTERS).content.decode()
    assert 'value="rebuild_selected"' not in html
    set_stored(alice, 5)
    client.post(COUNTERS, {"action": "rebuild_selected", "_selected_action": [alice.pk]})
    assert UnreadCounter.objects.get_count(alice) == 5  # nothing was repaired


@pytest.fixture
def by_actor(alice, bob, make_member):
    """alice's and bob's notifications, some from carol, some from dave, some without an actor."""
    carol, dave = make_member("carol"), make_member("dave")
    from_carol = notify(alice, 2, actor=carol) + notify(alice, 1, actor=carol, is_read=True)
    from_carol += notify(bob, 1, actor=carol)
    notify(alice, 2, actor=dave)
    notify(alice, 1)
    notify(bob, 1)
    return from_carol


@pytest.mark.parametrize(
    ("action", "post"),
    [
        pytest.param({"action": "mark_read"}, {}, id="mark-read"),
        pytest.param({"action": "delete_selected"}, {"post": "yes"}, id="delete-selected"),
    ],
)
def test_actions_after_a_search_by_actor_are_counted(staff, alice, bob, by_actor, action, post):
    changelist = f"{NOTIFICATIONS}?q=carol"
    assert len(verbs(staff.get(changelist).content.decode())) == len(by_actor)
    selected = {"_selected_action": [n.pk for n in by_actor]}
    if post:  # the confirmation page of delete_selected, then its form
        confirm = staff.post(changelist, {**action, **selected})
        assert confirm.status_code == 200
        assert "Are you sure" in confirm.content.decode()
    response = staff.post(changelist, {**action, **selected, **post})
    assert response.status_code == 302
    mine = Notification.objects.filter(pk__in=[n.pk for n in by_actor])
    if post:
        assert not mine.exists()
    else:
        assert not mine.filter(is_read=False).exists()
    assert (truth(alice), truth(bob)) == (3, 1)
    assert_exact(alice, bob)
