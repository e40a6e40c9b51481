"""A WSGI app for a real gunicorn worker: each request commits counted changes, which the
per-process sender queues (run it with a long ``COUNTERS_SEND_DELAY_MS``).

``GET /?user=7&notifications=3`` creates three notifications for user 7 and answers
``queued <n>``: what the worker's sender holds for that user's counter.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from urllib.parse import parse_qs

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django

django.setup()

from counters.write import sender  # noqa: E402
from notifications.models import Notification  # noqa: E402


def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
    query = parse_qs(environ.get("QUERY_STRING", ""))
    user = int(query["user"][0])
    for i in range(int(query.get("notifications", ["1"])[0])):
        Notification.objects.create(recipient_id=user, verb=f"queued {i}")
    queued = sender._senders["default"].queued([f"unread:{user}"])
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [f"queued {sum(queued.values())}".encode()]
