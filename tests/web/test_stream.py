"""The inbox's live stream (Server-Sent Events): a JSON 401 for anonymous, then for a user the
current state first, comment lines while idle, and a new state after each change of the
count, made by another thread; every count checked against SQL."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import AsyncClient

from tests.helpers import truth
from tests.web.conftest import notify

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.live]

URL = "/api/notifications/stream/"


def test_anonymous_gets_a_json_401(client):
    response = client.get(URL)
    assert response.status_code == 401
    assert response.json() == {"error": "authentication required"}


def test_under_wsgi_the_stream_is_refused_so_the_page_polls(alice, logged_in):
    response = logged_in(alice).get(URL)
    assert response.status_code == 503
    assert response.json() == {"error": "the live stream needs an ASGI server"}


def state(chunk: bytes) -> tuple[str, dict[str, Any]]:
    """The id and the data of a ``state`` event."""
    fields = dict(line.split(": ", 1) for line in chunk.decode().strip().split("\n"))
    assert fields["event"] == "state"
    return fields["id"], json.loads(fields["data"])


async def in_thread(fn: Any, *args: Any) -> Any:
    def call() -> Any:
        try:
            return fn(*args)
        finally:
            connections.close_all()

    return await sync_to_async(call, thread_sensitive=False)()


def test_state_first_then_heartbeats_then_a_state_per_change(alice, bob, settings):
    settings.NOTIFICATIONS_STREAM_HEARTBEAT = 0.2
    notify(alice, 2)
    notify(bob)

    async def scenario() -> None:
        client = AsyncClient()
        await client.aforce_login(alice)
        response = await client.get(URL)
        assert response.status_code == 200
        assert response["Content-Type"] == "text/event-stream"
        assert "no-cache" in response["Cache-Control"]
        chunks: AsyncIterator[bytes] = aiter(response.streaming_content)
        try:
            assert await anext(chunks) == b"retry: 2000\n\n"
            _, first = state(await anext(chunks))
            assert first["unread"] == 2 == await in_thread(truth, alice)
            assert [n["verb"] for n in first["notifications"]] == ["event 1", "event 0"]
            assert await asyncio.wait_for(anext(chunks), 5) == b": heartbeat\n\n"
            [new] = await in_thread(lambda: notify(alice, verb="replied"))
            chunk = await asyncio.wait_for(anext(chunks), 5)
            while chunk == b": heartbeat\n\n":
                chunk = await asyncio.wait_for(anext(chunks), 5)
            event_id, second = state(chunk)
            assert second["unread"] == 3 == await in_thread(truth, alice)
            assert second["notifications"][0]["id"] == new.pk
            assert event_id == f"{new.pk}.3"
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            await sync_to_async(connections.close_all)()

    asyncio.run(scenario())


def test_the_state_comes_before_any_heartbeat_however_slow_the_first_read(alice, settings):
    """A heartbeat shorter than the first read: the first chunk after ``retry`` is still the
    state, never a comment."""
    settings.NOTIFICATIONS_STREAM_HEARTBEAT = 0.0001
    notify(alice, 3)

    async def scenario() -> None:
        client = AsyncClient()
        await client.aforce_login(alice)
        response = await client.get(URL)
        chunks: AsyncIterator[bytes] = aiter(response.streaming_content)
        try:
            assert await anext(chunks) == b"retry: 2000\n\n"
            _, first = state(await asyncio.wait_for(anext(chunks), 5))
            assert first["unread"] == 3 == await in_thread(truth, alice)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            await sync_to_async(connections.close_all)()

    asyncio.run(scenario())
