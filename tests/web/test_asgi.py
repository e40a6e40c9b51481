"""The JSON API under a real ASGI server (uvicorn), with concurrent requests.

The count endpoint is an async view. uvicorn serves the project
(``config.asgi``) as a subprocess on the test database and this test's Redis
prefix. Several clients, one per user, each mark their notifications read
(a sync view) and poll their count (the async view) at the same time, while
this process flushes the buffer over and over: every count each client gets
is exactly what its own writes left, and at the end every count equals
``COUNT(*)`` in SQL, read through the server and from the stored rows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from asgiref.sync import iscoroutinefunction
from django.db import connections
from django.test import Client
from django.urls import resolve

import counters
from notifications.models import Notification
from tests.helpers import stored, truth
from tests.procs import ROOT, project_env
from tests.web.test_production import free_port, wait_for_port

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]

USERS = 6
NOTIFICATIONS = 8  # per user
MARKED = 5  # marked read by each client, one request at a time, each followed by a poll
COUNT_URL = "/api/notifications/unread-count/"
#: A CSRF secret the test sends as both the cookie and the header (Django's double submit).
CSRF = "a" * 32


@pytest.fixture
def uvicorn() -> Iterator[str]:
    """``uvicorn config.asgi:application``, as a platform would start it; its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "config.asgi:application",
            "--host=127.0.0.1",
            f"--port={port}",
            "--lifespan=off",
            "--no-access-log",
        ],
        cwd=ROOT,
        env=project_env(application_name="uvicorn"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_port(proc, port, time.monotonic() + 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert "Traceback" not in err, err[-4000:]


@dataclass
class Session:
    base: str
    cookie: str

    def call(self, path: str, method: str = "GET") -> tuple[int, dict]:
        request = urllib.request.Request(self.base + path, method=method)
        request.add_header("Cookie", self.cookie)
        if method == "POST":
            request.add_header("X-CSRFToken", CSRF)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def count(self) -> int:
        status, body = self.call(COUNT_URL)
        assert status == 200, body
        return body["unread"]


def session(base: str, user) -> Session:
    """A logged-in session of ``user``: its session row is in the test database."""
    client = Client()
    client.force_login(user)
    return Session(base, f"sessionid={client.cookies['sessionid'].value}; csrftoken={CSRF}")


def test_the_count_endpoint_is_an_async_view():
    assert iscoroutinefunction(resolve(COUNT_URL).func)


def test_concurrent_clients_read_exact_counts_under_uvicorn(uvicorn, make_user):
    users = [make_user() for _ in range(USERS)]
    for _ in range(NOTIFICATIONS):
        Notification.objects.notify(users, verb="v")
    sessions = {user.pk: session(uvicorn, user) for user in users}
    assert Session(uvicorn, "").call(COUNT_URL) == (401, {"error": "authentication required"})

    def client(user) -> list[tuple[int, int]]:
        """Mark MARKED notifications read, polling after each: (count seen, count expected)."""
        own = sessions[user.pk]
        ids = list(
            Notification.objects.filter(recipient=user).order_by("pk").values_list("pk", flat=True)
        )
        connections.close_all()  # this thread's connection: the rest goes through the server
        seen = [(own.count(), NOTIFICATIONS)]
        for i, pk in enumerate(ids[:MARKED]):
            status, body = own.call(f"/api/notifications/{pk}/read/", "POST")
            assert (status, body["changed"]) == (200, True), body
            seen.append((body["unread"], NOTIFICATIONS - i - 1))
            seen.append((own.count(), NOTIFICATIONS - i - 1))
        status, body = own.call(f"/api/notifications/{ids[0]}/unread/", "POST")
        assert (status, body["changed"]) == (200, True), body
        seen.append((own.count(), NOTIFICATIONS - MARKED + 1))
        return seen

    done = threading.Event()
    flushes = []

    def flusher() -> None:
        try:
            while not done.is_set():
                flushes.append(counters.flush().keys)
        finally:
            connections.close_all()

    background = threading.Thread(target=flusher)
    background.start()
    try:
        with ThreadPoolExecutor(max_workers=USERS) as pool:
            seen = dict(zip([u.pk for u in users], pool.map(client, users), strict=True))
    finally:
        done.set()
        background.join(timeout=60)
    assert sum(flushes) > 0  # the flushes ran between the requests, and applied deltas
    for pk, pairs in seen.items():
        assert [got for got, _ in pairs] == [want for _, want in pairs], pk
    expected = {user.pk: truth(user) for user in users}
    assert set(expected.values()) == {NOTIFICATIONS - MARKED + 1}

    # Every user's count, polled by many requests at once, equals SQL: before and after a flush.
    polls = [u for u in users for _ in range(8)]
    for _ in range(2):
        with ThreadPoolExecutor(max_workers=16) as pool:
            counts = list(pool.map(lambda u: (u.pk, sessions[u.pk].count()), polls))
        assert counts == [(u.pk, expected[u.pk]) for u in polls]
        counters.flush()
    assert {user.pk: stored(user) for user in users} == expected
