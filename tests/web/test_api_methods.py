"""HEAD and OPTIONS on the JSON API, and request bodies over the size limit."""

from __future__ import annotations

import pytest

from notifications.models import Notification
from tests.helpers import assert_exact, truth
from tests.web.conftest import notify

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

API = "/api/notifications/"

GET_ENDPOINTS = [
    pytest.param(API, id="list"),
    pytest.param(f"{API}unread-count/", id="unread-count"),
    pytest.param(f"{API}{{id}}/", id="detail"),
    pytest.param("/api/openapi.json", id="openapi"),
]

ALLOW = [
    pytest.param(API, "GET, HEAD, OPTIONS", id="list"),
    pytest.param(f"{API}unread-count/", "GET, HEAD, OPTIONS", id="unread-count"),
    pytest.param(f"{API}{{id}}/", "GET, HEAD, DELETE, OPTIONS", id="detail"),
    pytest.param(f"{API}{{id}}/read/", "POST, OPTIONS", id="read"),
    pytest.param(f"{API}{{id}}/unread/", "POST, OPTIONS", id="unread"),
    pytest.param(f"{API}read-all/", "POST, OPTIONS", id="read-all"),
    pytest.param("/api/openapi.json", "GET, HEAD, OPTIONS", id="openapi"),
]


def json_error(response) -> str:
    assert response["Content-Type"] == "application/json", response.content
    return response.json()["error"]


@pytest.mark.parametrize("url", GET_ENDPOINTS)
def test_head_answers_like_get_without_a_body(alice, logged_in, url):
    (n,) = notify(alice, 1)
    client = logged_in(alice)
    url = url.format(id=n.pk)
    get, head = client.get(url), client.head(url)
    assert (get.status_code, head.status_code) == (200, 200)
    assert head.content == b""
    assert head["Content-Type"] == get["Content-Type"] == "application/json"
    assert head["Content-Length"] == str(len(get.content))
    assert head["Cache-Control"] == get["Cache-Control"]


def test_head_needs_a_login_and_an_existing_notification(alice, bob, client, logged_in):
    (theirs,) = notify(bob, 1)
    assert client.head(f"{API}unread-count/").status_code == 401
    response = logged_in(alice).head(f"{API}{theirs.pk}/")
    assert (response.status_code, response.content) == (404, b"")
    assert logged_in(alice).head(f"{API}abc/").status_code == 400


@pytest.mark.parametrize(("url", "allow"), ALLOW)
def test_options_answers_200_with_allow(alice, client, url, allow):
    (n,) = notify(alice, 1)
    response = client.options(url.format(id=n.pk))  # no login needed, nothing changes
    assert response.status_code == 200
    assert response["Allow"] == allow
    assert response.json() == {"allow": allow.split(", ")}
    assert "no-store" in response["Cache-Control"]
    assert Notification.objects.filter(pk=n.pk, is_read=False).exists()
    assert_exact(alice)


def test_options_on_an_unknown_api_path_is_a_json_404(client):
    response = client.options("/api/nothing/")
    assert (response.status_code, json_error(response)) == (404, "not found")


@pytest.mark.parametrize(
    ("content_type", "limit"),
    [
        pytest.param("application/json", 100, id="json-small-limit"),
        pytest.param("application/x-www-form-urlencoded", 100, id="form-small-limit"),
        pytest.param("application/json", None, id="json-default-limit"),
    ],
)
def test_oversized_body_is_a_json_413(alice, logged_in, settings, content_type, limit):
    if limit is not None:
        settings.DATA_UPLOAD_MAX_MEMORY_SIZE = limit
    size = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    notify(alice, 2)
    client = logged_in(alice)
    fits = b'{"until_id": null}'.ljust(size) if content_type == "application/json" else b""
    too_big = b"x=" + b"1" * (size - 1)
    response = client.post(f"{API}read-all/", too_big, content_type=content_type)
    assert response.status_code == 413
    assert json_error(response) == f"request body is larger than {size} bytes"
    assert truth(alice) == 2  # nothing was marked
    response = client.post(f"{API}read-all/", fits, content_type=content_type)
    assert (response.status_code, response.json()) == (200, {"changed": 2, "unread": 0})
    assert_exact(alice)


def test_oversized_body_on_delete_is_a_413_and_deletes_nothing(alice, logged_in, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10
    (n,) = notify(alice, 1)
    response = logged_in(alice).delete(f"{API}{n.pk}/", b"x" * 11, content_type="text/plain")
    assert (response.status_code, json_error(response)) == (
        413,
        "request body is larger than 10 bytes",
    )
    assert Notification.objects.filter(pk=n.pk).exists()
    assert_exact(alice)


def test_malformed_content_length_is_a_json_400(alice, logged_in):
    response = logged_in(alice).post(
        f"{API}read-all/", b"{}", content_type="application/json", CONTENT_LENGTH="abc"
    )
    assert (response.status_code, json_error(response)) == (
        400,
        "Content-Length must be an integer",
    )
