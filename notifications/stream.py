"""The inbox's live stream: Server-Sent Events of the logged-in user's unread count and newest
notifications, pushed as they change (``GET /api/notifications/stream/``).

An async view under ASGI: it watches the user's live unread counter
(:func:`counters.awatch`), which wakes it on every change of the count: a
notification created, read, unread or deleted, by any process. Each event
``state`` carries the exact count and the newest notifications (the first
page of the inbox), so the page adds the new ones and shows the read state of
the others. The current state comes first on every connection, so a tab that
reconnects (``EventSource`` does it by itself, its ``Last-Event-ID`` being
only informative here) is brought up to date at once. A comment line every
``NOTIFICATIONS_STREAM_HEARTBEAT`` seconds (default 15) keeps proxies from
closing an idle stream and lets the server notice a client gone.

Anonymous: a JSON 401, like the rest of the API; a 503 under a WSGI server (the
page then polls). One subscriber connection to
Redis per web process serves every stream of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.db import close_old_connections, connections
from django.db.models import F, Window
from django.db.models.functions import RowNumber
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse

import counters

from .api import endpoint, error, serialize
from .apps import UNREAD_COUNTER
from .models import Notification

#: Newest notifications sent with each state (the inbox's first page).
NEWEST = 20


def heartbeat_seconds() -> float:
    """Seconds between two comment lines of an idle stream (``NOTIFICATIONS_STREAM_HEARTBEAT``)."""
    return float(getattr(settings, "NOTIFICATIONS_STREAM_HEARTBEAT", 15))


def newest(user_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    """The newest notifications of each user, as the JSON API gives them: one query for
    all, in a thread of the event loop's shared pool (the request's own thread would hold
    its database connection as long as the stream runs), its connection closed after it
    unless ``CONN_MAX_AGE`` keeps it."""
    close_old_connections()
    try:
        rank = Window(RowNumber(), partition_by=F("recipient_id"), order_by=F("pk").desc())
        rows = (
            Notification.objects.filter(recipient_id__in=user_ids)
            .select_related("actor")
            .annotate(rank=rank)
            .filter(rank__lte=NEWEST)
            .order_by("recipient_id", "-pk")
        )
        out: dict[int, list[dict[str, Any]]] = {uid: [] for uid in user_ids}
        for n in rows:
            out[n.recipient_id].append(serialize(n))
        return out
    finally:
        close_old_connections()


class Newest:
    """The newest notifications the streams of one event loop ask for, read by one query at
    a time: it answers every stream that asked before it started (those one change of many
    counts woke ask in the same turn of the loop; those woken while it runs, by the next)."""

    def __init__(self) -> None:
        self.waiting: dict[int, list[asyncio.Future[list[dict[str, Any]]]]] = {}
        self.running: asyncio.Task[None] | None = None

    async def get(self, user_id: int) -> list[dict[str, Any]]:
        future: asyncio.Future[list[dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(user_id, []).append(future)
        if self.running is None:
            self.running = asyncio.ensure_future(self._run())
        return await future

    async def _run(self) -> None:
        try:
            await asyncio.sleep(0)  # the other streams woken with this one ask first
            while self.waiting:
                waiting, self.waiting = self.waiting, {}
                await self._answer(waiting)
        finally:
            self.running = None

    async def _answer(self, waiting: dict[int, list[asyncio.Future[list[dict[str, Any]]]]]) -> None:
        error_: Exception | None = None
        found: dict[int, list[dict[str, Any]]] = {}
        try:
            found = await sync_to_async(newest, thread_sensitive=False)(list(waiting))
        except Exception as exc:
            error_ = exc
        for user_id, futures in waiting.items():
            for future in futures:
                if future.done():
                    continue
                if error_ is not None:
                    future.set_exception(error_)
                else:
                    future.set_result(found[user_id])


_newest: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Newest] = weakref.WeakKeyDictionary()


async def read_newest(user_id: int) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    batch = _newest.get(loop)
    if batch is None:
        batch = _newest[loop] = Newest()
    return await batch.get(user_id)


def event(name: str, data: dict[str, Any], event_id: str) -> str:
    """One Server-Sent Event (the data on one line: JSON has no raw newline)."""
    return f"id: {event_id}\nevent: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def states(user_id: int, heartbeat: float) -> AsyncIterator[str]:
    """The stream's text: the state at once, again after every change, comments between."""
    yield "retry: 2000\n\n"  # EventSource reconnects after 2 s
    watch = counters.awatch(UNREAD_COUNTER, user_id)
    pending: asyncio.Task[int] | None = None
    wait: float | None = None  # the first state comes before any comment, however slow
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(watch))
            done, _ = await asyncio.wait({pending}, timeout=wait)
            wait = heartbeat
            if not done:
                yield ": heartbeat\n\n"
                continue
            unread, pending = pending.result(), None
            items = await read_newest(user_id)
            top = items[0]["id"] if items else 0
            yield event("state", {"unread": unread, "notifications": items}, f"{top}.{unread}")
    finally:
        if pending is not None:  # its cancellation ends the watch (the generator's finally)
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await watch.aclose()


@endpoint("GET")
async def stream(request: HttpRequest) -> HttpResponseBase:
    if not isinstance(request, ASGIRequest):
        # Under WSGI an endless stream would hold a worker thread for good: the page polls.
        return error(503, "the live stream needs an ASGI server")
    user = await request.auser()  # logged in: the endpoint answered 401 otherwise
    # The session and the user were read in the request's own thread: its connection is
    # closed now, not when the stream ends.
    await sync_to_async(connections.close_all)()
    response = StreamingHttpResponse(
        states(user.pk or 0, heartbeat_seconds()), content_type="text/event-stream"
    )
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response
