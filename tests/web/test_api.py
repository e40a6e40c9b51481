"""The JSON API through the Django test client: exact counts, other users' ids, bad input."""

from __future__ import annotations

import json

import pytest

from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, truth
from tests.web.conftest import notify

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

API = "/api/notifications/"
MAX_ID = 2**63 - 1
BAD_IDS = ["abc", "0", "-1", "01", "1.5", "1e3", "+1", "\u0661", str(MAX_ID + 1), "9" * 30]

ENDPOINTS = [
    ("get", API),
    ("get", f"{API}unread-count/"),
    ("post", f"{API}read-all/"),
    ("get", f"{API}1/"),
    ("delete", f"{API}1/"),
    ("post", f"{API}1/read/"),
    ("post", f"{API}1/unread/"),
]


def body(response) -> dict:
    assert response["Content-Type"] == "application/json", response.content
    return response.json()


def test_every_endpoint_needs_a_login(client):
    for method, url in ENDPOINTS:
        response = getattr(client, method)(url)
        assert response.status_code == 401, (method, url)
        assert body(response) == {"error": "authentication required"}
        assert "no-store" in response["Cache-Control"]


def test_unread_count_is_exact_and_never_cached(alice, bob, logged_in):
    notify(alice, 3)
    notify(bob, 2)
    Notification.objects.create(recipient=alice, verb="seen", is_read=True)
    response = logged_in(alice).get(f"{API}unread-count/")
    assert response.status_code == 200
    assert body(response) == {"unread": 3} == {"unread": truth(alice)}
    assert "no-store" in response["Cache-Control"]


def test_list_pages_newest_first_with_only_own_notifications(alice, bob, logged_in):
    mine = notify(alice, 25)
    notify(bob, 4)
    client = logged_in(alice)
    first = body(client.get(API, {"page_size": 10}))
    assert [n["id"] for n in first["results"]] == [n.pk for n in reversed(mine)][:10]
    assert first["previous"] is None
    assert first["next"] == f"{API}?page=2&page_size=10"
    assert first["unread"] == truth(alice) == 25
    third = body(client.get(first["next"].replace("page=2", "page=3")))
    assert [n["id"] for n in third["results"]] == [n.pk for n in reversed(mine)][20:]
    assert third["next"] is None
    assert third["previous"] == f"{API}?page=2&page_size=10"
    item = third["results"][-1]
    assert item == {
        "id": mine[0].pk,
        "verb": mine[0].verb,
        "description": "",
        "actor": None,
        "created_at": mine[0].created_at.isoformat(),
        "is_read": False,
        "read_at": None,
        "url": f"{API}{mine[0].pk}/",
    }


def test_list_filters_by_unread(alice, bob, logged_in):
    unread = notify(alice, 2)
    read = notify(alice, 3, is_read=True)
    client = logged_in(alice)
    ids = {n["id"] for n in body(client.get(API, {"unread": "true"}))["results"]}
    assert ids == {n.pk for n in unread}
    ids = {n["id"] for n in body(client.get(API, {"unread": "false"}))["results"]}
    assert ids == {n.pk for n in read}
    page = body(client.get(API, {"unread": "true", "page_size": 1}))
    assert page["next"] == f"{API}?page=2&page_size=1&unread=true"


BAD_LIST_QUERIES = [
    {"page": "0"},
    {"page": "-1"},
    {"page": "abc"},
    {"page": "1.5"},
    {"page": "01"},
    {"page": " 1"},
    {"page": "\uff11"},  # fullwidth digit one: int() would take it
    {"page": ""},
    {"page": "10001"},
    {"page": "9" * 40},
    {"page_size": "0"},
    {"page_size": "101"},
    {"unread": "yes"},
    {"unread": "1"},
    {"unread": "True"},
    {"unread": ""},
]


def test_list_rejects_bad_parameters(alice, logged_in):
    client = logged_in(alice)
    for query in BAD_LIST_QUERIES:
        response = client.get(API, query)
        assert response.status_code == 400, query
        (name,) = query
        assert body(response)["error"].startswith(f"{name}: "), query


def test_mark_read_and_unread_count_once(alice, logged_in):
    n, _ = notify(alice, 2)
    client = logged_in(alice)
    first = client.post(f"{API}{n.pk}/read/")
    assert first.status_code == 200
    data = body(first)
    assert (data["changed"], data["unread"]) == (True, 1)
    assert data["notification"]["is_read"] is True
    assert data["notification"]["read_at"] is not None
    again = body(client.post(f"{API}{n.pk}/read/"))
    assert (again["changed"], again["unread"]) == (False, 1)
    assert truth(alice) == 1
    assert_exact(alice)
    back = body(client.post(f"{API}{n.pk}/unread/"))
    assert (back["changed"], back["unread"], back["notification"]["read_at"]) == (True, 2, None)
    assert body(client.post(f"{API}{n.pk}/unread/"))["changed"] is False
    assert_exact(alice)
    assert UnreadCounter.objects.get_count(alice) == 2


def test_get_one_notification(alice, bob, logged_in):
    (n,) = notify(alice, 1, verb="mentioned you", description="in #general", actor=bob)
    data = body(logged_in(alice).get(f"{API}{n.pk}/"))
    assert (data["id"], data["verb"], data["description"], data["actor"]) == (
        n.pk,
        "mentioned you",
        "in #general",
        "bob",
    )


def test_delete_counts_unread_rows_only(alice, logged_in):
    unread = notify(alice, 2)
    (read,) = notify(alice, 1, is_read=True)
    client = logged_in(alice)
    response = client.delete(f"{API}{unread[0].pk}/")
    assert response.status_code == 200
    assert body(response) == {"id": unread[0].pk, "deleted": True, "unread": 1}
    assert body(client.delete(f"{API}{read.pk}/"))["unread"] == 1
    assert client.delete(f"{API}{read.pk}/").status_code == 404
    assert client.get(f"{API}{read.pk}/").status_code == 404
    assert not Notification.objects.filter(pk__in=[unread[0].pk, read.pk]).exists()
    assert_exact(alice)


def test_read_all_marks_every_unread_notification(alice, bob, logged_in):
    notify(alice, 4)
    notify(bob, 2)
    response = logged_in(alice).post(f"{API}read-all/")
    assert response.status_code == 200
    assert body(response) == {"changed": 4, "unread": 0}
    assert (truth(alice), truth(bob)) == (0, 2)
    assert_exact(alice, bob)


def test_read_all_until_id_leaves_newer_ones_unread(alice, logged_in):
    older = notify(alice, 3)
    newer = notify(alice, 2)
    response = logged_in(alice).post(
        f"{API}read-all/", {"until_id": older[-1].pk}, content_type="application/json"
    )
    assert body(response) == {"changed": 3, "unread": 2}
    assert set(Notification.objects.filter(is_read=False).values_list("pk", flat=True)) == {
        n.pk for n in newer
    }
    assert_exact(alice)


def test_read_all_accepts_empty_object_and_null(alice, logged_in):
    notify(alice, 2)
    client = logged_in(alice)
    assert body(client.post(f"{API}read-all/", {}, content_type="application/json")) == {
        "changed": 2,
        "unread": 0,
    }
    response = client.post(f"{API}read-all/", {"until_id": None}, content_type="application/json")
    assert body(response) == {"changed": 0, "unread": 0}


BAD_BODIES = [
    (b"not json", "application/json"),
    (b"{", "application/json"),
    (b"[]", "application/json"),
    (b'"x"', "application/json"),
    (b"null", "application/json"),
    (b'{"until_id": "5"}', "application/json"),
    (b'{"until_id": 0}', "application/json"),
    (b'{"until_id": -3}', "application/json"),
    (b'{"until_id": 1.5}', "application/json"),
    (b'{"until_id": true}', "application/json"),
    (b'{"until_id": NaN}', "application/json"),
    (b'{"until_id": 1e400}', "application/json"),
    (b'{"until_id": 9223372036854775808}', "application/json"),
    (b'{"until": 5}', "application/json"),
    (b"\xff\xfe", "application/json"),
    (b"[" * 100_000, "application/json"),
    (b"until_id=5", "application/x-www-form-urlencoded"),
    (b'{"until_id": 5}', "text/plain"),
]


def test_read_all_rejects_malformed_bodies(alice, logged_in):
    notify(alice, 2)
    client = logged_in(alice)
    for raw, content_type in BAD_BODIES:
        response = client.post(f"{API}read-all/", raw, content_type=content_type)
        assert response.status_code == 400, raw[:40]
        assert "error" in body(response)
    assert truth(alice) == 2  # nothing was marked
    assert_exact(alice)


@pytest.mark.parametrize(
    ("method", "suffix"),
    [("get", ""), ("delete", ""), ("post", "read/"), ("post", "unread/")],
)
def test_another_users_notification_is_a_404_like_a_missing_one(
    alice, bob, logged_in, method, suffix
):
    (theirs,) = notify(bob, 1)
    client = logged_in(alice)
    response = getattr(client, method)(f"{API}{theirs.pk}/{suffix}")
    missing = getattr(client, method)(f"{API}{MAX_ID}/{suffix}")
    assert (response.status_code, body(response)) == (404, {"error": "no such notification"})
    assert (missing.status_code, body(missing)) == (404, body(response))
    theirs.refresh_from_db()
    assert theirs.is_read is False
    assert_exact(alice, bob)


@pytest.mark.parametrize(
    ("method", "suffix"),
    [("get", ""), ("delete", ""), ("post", "read/"), ("post", "unread/")],
)
def test_malformed_ids_are_a_400(alice, logged_in, method, suffix):
    client = logged_in(alice)
    for raw_id in BAD_IDS:
        response = getattr(client, method)(f"{API}{raw_id}/{suffix}")
        assert response.status_code == 400, raw_id
        assert body(response) == {"error": f"id: must be an integer from 1 to {MAX_ID}"}


WRONG_METHODS = [
    ("post", API, "GET, HEAD, OPTIONS"),
    ("put", f"{API}unread-count/", "GET, HEAD, OPTIONS"),
    ("get", f"{API}read-all/", "POST, OPTIONS"),
    ("patch", f"{API}1/", "GET, HEAD, DELETE, OPTIONS"),
    ("get", f"{API}1/read/", "POST, OPTIONS"),
    ("delete", f"{API}1/unread/", "POST, OPTIONS"),
    ("post", "/api/openapi.json", "GET, HEAD, OPTIONS"),
]


def test_wrong_method_is_a_405_with_allow(alice, logged_in):
    client = logged_in(alice)
    for method, url, allow in WRONG_METHODS:
        response = getattr(client, method)(url)
        assert (response.status_code, response["Allow"]) == (405, allow), (method, url)
        assert body(response)["error"].startswith(f"method {method.upper()} ")


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("post", f"{API}{{id}}/read/"),
        ("post", f"{API}{{id}}/unread/"),
        ("delete", f"{API}{{id}}/"),
        ("post", f"{API}read-all/"),
    ],
)
def test_unsafe_methods_need_the_csrf_token(alice, logged_in, method, url):
    (n,) = notify(alice, 1)
    client = logged_in(alice, enforce_csrf_checks=True)
    url = url.format(id=n.pk)
    response = getattr(client, method)(url)
    assert response.status_code == 403
    assert body(response)["error"].startswith("CSRF check failed")
    n.refresh_from_db()
    assert Notification.objects.filter(pk=n.pk, is_read=False).exists()
    assert_exact(alice)
    # The same request with the token from the cookie goes through.
    client.get("/notifications/")  # sets the csrftoken cookie
    token = client.cookies["csrftoken"].value
    assert getattr(client, method)(url, HTTP_X_CSRFTOKEN=token).status_code == 200
    assert_exact(alice)


def test_wrong_csrf_token_is_rejected(alice, logged_in):
    (n,) = notify(alice, 1)
    client = logged_in(alice, enforce_csrf_checks=True)
    client.get("/notifications/")
    response = client.post(f"{API}{n.pk}/read/", HTTP_X_CSRFTOKEN="x" * 32)
    assert response.status_code == 403
    assert truth(alice) == 1


def test_unknown_api_paths_are_json_404s(alice, logged_in):
    client = logged_in(alice)
    for url in ("/api/", "/api/nothing", f"{API}1/2/3/", f"{API}1/archive/"):
        response = client.get(url)
        assert (response.status_code, body(response)) == (404, {"error": "not found"}), url
    response = client.post("/api/notifications/1/read")
    assert response.status_code == 404
    assert body(response) == {"error": "not found; did you mean /api/notifications/1/read/ ?"}


def test_openapi_document_covers_every_endpoint(client):
    response = client.get("/api/openapi.json")
    assert response.status_code == 200
    doc = body(response)
    assert doc["openapi"].startswith("3.")
    operations = {
        (method.upper(), path)
        for path, item in doc["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert operations == {
        ("GET", API),
        ("HEAD", API),
        ("GET", f"{API}unread-count/"),
        ("HEAD", f"{API}unread-count/"),
        ("POST", f"{API}read-all/"),
        ("GET", f"{API}{{id}}/"),
        ("HEAD", f"{API}{{id}}/"),
        ("DELETE", f"{API}{{id}}/"),
        ("POST", f"{API}{{id}}/read/"),
        ("POST", f"{API}{{id}}/unread/"),
    }
    assert json.dumps(doc)  # serializable as served
