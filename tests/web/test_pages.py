"""The inbox page, its form actions, login/logout and static files, through the test client."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from notifications.models import Notification
from tests.helpers import assert_exact, truth
from tests.web.conftest import PASSWORD, notify

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

INBOX = "/notifications/"


class Tags(HTMLParser):
    """Start tags with their attributes, in document order."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [
            a
            for t, a in self.tags
            if t == tag and all(a.get(k.rstrip("_")) == v for k, v in attrs.items())
        ]


def badge(response) -> int:
    match = re.search(r'<span id="unread-count">(\d+)</span>', response.content.decode())
    assert match, "no badge on the page"
    return int(match[1])


def test_root_and_inbox_need_a_login(client):
    assert client.get("/").url == INBOX
    response = client.get(INBOX)
    assert response.status_code == 302
    assert response.url == f"/accounts/login/?next={INBOX}"


def test_login_form_is_labelled_and_logs_in(client, alice):
    page = client.get("/accounts/login/")
    assert page.status_code == 200
    tags = Tags(page.content.decode())
    for name in ("username", "password"):
        (field,) = tags.find("input", name=name)
        assert tags.find("label", for_=field["id"]), f"{name} has no label"
    assert tags.find("html", lang="en")
    response = client.post(
        "/accounts/login/", {"username": "alice", "password": PASSWORD, "next": INBOX}
    )
    assert (response.status_code, response.url) == (302, INBOX)
    assert client.get(INBOX).status_code == 200


def test_wrong_password_shows_an_alert(client, alice):
    response = client.post("/accounts/login/", {"username": "alice", "password": "nope"})
    assert response.status_code == 200
    assert 'role="alert"' in response.content.decode()


def test_logout_is_a_post_and_ends_the_session(alice, logged_in):
    client = logged_in(alice)
    assert client.get("/accounts/logout/").status_code == 405
    response = client.post("/accounts/logout/")
    assert (response.status_code, response.url) == (302, "/accounts/login/")
    assert client.get("/api/notifications/unread-count/").status_code == 401


def test_inbox_lists_own_notifications_with_the_exact_badge(alice, bob, logged_in):
    unread = notify(alice, 3, verb="commented on your post")
    (read,) = notify(alice, 1, verb="starred your repository", is_read=True)
    notify(bob, 2, verb="bob's secret")
    response = logged_in(alice).get(INBOX)
    html = response.content.decode()
    assert badge(response) == truth(alice) == 3
    assert "bob&#x27;s secret" not in html and "bob's secret" not in html
    for n in unread:
        assert f'id="notification-{n.pk}"' in html
        assert f'action="/notifications/{n.pk}/read/"' in html
    assert f'action="/notifications/{read.pk}/unread/"' in html
    assert html.count('class="notification is-unread"') == 3
    assert html.count('<span class="pill">Unread</span>') == 3
    assert "<title>(3) Notifications · Tally</title>" in html
    assert 'data-count-url="/api/notifications/unread-count/"' in html


def test_unread_tab_and_pagination(alice, logged_in):
    notify(alice, 25)
    notify(alice, 3, is_read=True)
    client = logged_in(alice)
    first = client.get(INBOX).content.decode()
    assert len(re.findall(r'<li class="notification', first)) == 20
    assert 'rel="next" href="?show=all&amp;page=2"' in first
    assert 'rel="prev"' not in first
    second = client.get(INBOX, {"page": "2"}).content.decode()
    assert len(re.findall(r'<li class="notification', second)) == 8
    assert 'rel="prev" href="?show=all&amp;page=1"' in second
    assert 'rel="next"' not in second
    unread = client.get(INBOX, {"show": "unread", "page": "2"}).content.decode()
    assert unread.count('class="notification is-unread"') == 5
    empty = client.get(INBOX, {"page": "9"}).content.decode()
    assert "No notifications on this page." in empty


def test_bad_inbox_parameters_are_a_400(alice, logged_in):
    client = logged_in(alice)
    for query in ({"page": "0"}, {"page": "x"}, {"page": "99999"}, {"show": "read"}):
        response = client.get(INBOX, query)
        assert response.status_code == 400, query
        assert 'role="alert"' in response.content.decode()


def test_mark_read_and_unread_forms_change_the_badge_by_one(alice, logged_in):
    n, _ = notify(alice, 2)
    client = logged_in(alice)
    response = client.post(f"/notifications/{n.pk}/read/", {"next": f"{INBOX}?page=1"})
    assert (response.status_code, response.url) == (302, f"{INBOX}?page=1")
    page = client.get(response.url)
    assert badge(page) == truth(alice) == 1
    assert f"Marked read: {n.verb}" in page.content.decode()
    assert_exact(alice)
    client.post(f"/notifications/{n.pk}/unread/")
    assert badge(client.get(INBOX)) == truth(alice) == 2
    assert_exact(alice)


def test_delete_form_removes_the_notification(alice, logged_in):
    n, _ = notify(alice, 2)
    client = logged_in(alice)
    assert client.post(f"/notifications/{n.pk}/delete/").status_code == 302
    assert not Notification.objects.filter(pk=n.pk).exists()
    assert badge(client.get(INBOX)) == truth(alice) == 1
    assert_exact(alice)


def test_mark_all_read_spares_notifications_newer_than_the_page(alice, logged_in):
    notify(alice, 3)
    client = logged_in(alice)
    page = Tags(client.get(INBOX).content.decode())
    (until,) = page.find("input", name="until_id")
    (newer,) = notify(alice, 1, verb="arrived after the page was shown")
    response = client.post("/notifications/read-all/", {"until_id": until["value"]})
    assert response.status_code == 302
    assert list(Notification.objects.filter(is_read=False)) == [newer]
    assert badge(client.get(INBOX)) == truth(alice) == 1
    client.post("/notifications/read-all/", {"until_id": ""})
    assert truth(alice) == 0
    assert_exact(alice)


def test_mark_all_read_rejects_a_bad_limit(alice, logged_in):
    notify(alice, 2)
    client = logged_in(alice)
    for until_id in ("x", "0", "-5", "1" * 25):
        response = client.post("/notifications/read-all/", {"until_id": until_id})
        assert response.status_code == 400, until_id
    assert truth(alice) == 2


@pytest.mark.parametrize("action", ["read", "unread", "delete"])
def test_actions_on_other_users_or_malformed_ids_are_404s(alice, bob, logged_in, action):
    (theirs,) = notify(bob, 1)
    client = logged_in(alice)
    for raw in (str(theirs.pk), "abc", "0", "9" * 30):
        assert client.post(f"/notifications/{raw}/{action}/").status_code == 404, raw
    assert Notification.objects.filter(pk=theirs.pk, is_read=False).exists()
    assert client.get(f"/notifications/{theirs.pk}/{action}/").status_code == 405
    assert_exact(alice, bob)


def test_forms_need_the_csrf_token(alice, logged_in):
    (n,) = notify(alice, 1)
    client = logged_in(alice, enforce_csrf_checks=True)
    assert client.post(f"/notifications/{n.pk}/read/").status_code == 403
    assert client.post("/notifications/read-all/").status_code == 403
    assert truth(alice) == 1
    page = Tags(client.get(INBOX).content.decode())
    token = page.find("input", name="csrfmiddlewaretoken")[0]["value"]
    response = client.post(f"/notifications/{n.pk}/read/", {"csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert truth(alice) == 0


def test_next_never_leaves_the_site(alice, logged_in):
    (n,) = notify(alice, 1)
    client = logged_in(alice)
    for target in ("https://example.com/", "//example.com/", "javascript:x"):
        response = client.post(f"/notifications/{n.pk}/read/", {"next": target})
        assert response.url == INBOX, target


def test_static_files_are_local_and_served(alice, client, logged_in):
    notify(alice, 1)
    html = logged_in(alice).get(INBOX).content.decode()
    tags = Tags(html)
    urls = [a["href"] for _, a in tags.tags if "href" in a] + [
        a["src"] for _, a in tags.tags if "src" in a
    ]
    assert all(not re.match(r"(https?:)?//", url) for url in urls), urls
    (css,) = tags.find("link", rel="stylesheet")
    (js,) = [a for t, a in tags.tags if t == "script"]
    for asset in (css["href"], js["src"]):
        response = client.get(asset)
        assert response.status_code == 200, asset
        body = b"".join(response.streaming_content)
        assert b"http://" not in body and b"https://" not in body
        response.close()


def test_every_button_has_a_name_and_focus_is_visible(alice, logged_in, client):
    notify(alice, 2)
    html = logged_in(alice).get(INBOX).content.decode()
    for label in re.findall(r"<button[^>]*>(.*?)</button>", html, re.S):
        assert re.sub(r"<[^>]+>", "", label).strip(), "a button without a name"
    assert 'class="skip-link" href="#main"' in html
    css = b"".join(client.get("/static/notifications/tally.css").streaming_content).decode()
    assert ":focus-visible" in css and "outline: 3px solid" in css
