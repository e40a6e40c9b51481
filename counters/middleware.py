"""``AcknowledgeMiddleware``: a response leaves once the pushes of its request are acknowledged.

With the sender (``COUNTERS_SEND_DELAY_MS`` > 0) it first pushes the
process's queue, the request's commits merged with whatever else the process
committed meanwhile: the deltas of a request reach Redis before its response
is returned, however long the sender's delay.

With ``COUNTERS_DEFER_ACKS`` on (the default) a committed push is written to
Redis and its reply read later (:mod:`counters.write.acks`). This middleware
reads the replies still waiting before the response is returned, so other
processes read the request's changes by the time its client has the
response. While a sync request is served, its thread writes each push as its
COMMIT ends, so that its reply has arrived by then, even where
``COUNTERS_WRITE_BATCH`` has the pushes of other code written in batches;
the read before an async response writes what its request left. Put it
first in ``MIDDLEWARE``, so that it runs after every other middleware (and
``ATOMIC_REQUESTS``) has committed::

    MIDDLEWARE = ["counters.middleware.AcknowledgeMiddleware", ...]

A process that serves requests without it waits on every push instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.http import HttpRequest, HttpResponseBase

from counters.write import acks, sender


class AcknowledgeMiddleware:
    """Push this process's queue and acknowledge its waiting pushes before each response."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
        acks.middleware_loaded()

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self.is_async:
            return self.__acall__(request)
        acks.serving(True)
        try:
            response = self.get_response(request)
        finally:
            acks.serving(False)
        sender.push_queued()
        return response

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        response = await self.get_response(request)
        await sync_to_async(sender.push_queued, thread_sensitive=True)()
        return response
