"""Reads: ``UnreadCounter.objects.get_count`` against ``COUNT(*)`` of unread rows."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from notifications.models import Notification, UnreadCounter

from . import data


def prepare(prefix: str, total: int, unread: int) -> int:
    """A reader with ``unread`` unread notifications among ``total``; returns its id.

    The rest of the notifications belong to the other bench users, half of them
    read. The reader's counter row holds its true count, as after a flush.
    """
    reader = data.create_user(f"{prefix}-reader")
    data.insert_notifications(reader, unread, total - unread, prefix)
    UnreadCounter.objects.create(user_id=reader, count=unread)
    data.analyze(Notification._meta.db_table)
    return reader


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def measure(reader: int, total: int, samples: int) -> dict:
    """Median latency of each read, alternating them, after a few unrecorded calls."""

    def get_count() -> int:
        return UnreadCounter.objects.get_count(reader)

    def count() -> int:
        return Notification.objects.filter(recipient_id=reader, is_read=False).count()

    reads: dict[str, Callable[[], int]] = {"get_count": get_count, "count": count}
    values = {name: read() for name, read in reads.items()}
    for read in list(reads.values()) * 3:
        read()
    timings: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(samples):
        for name, read in reads.items():
            started = time.perf_counter()
            read()
            timings[name].append(time.perf_counter() - started)
    get_count_ms = _median_ms(timings["get_count"])
    count_ms = _median_ms(timings["count"])
    return {
        "notifications": total,
        "table_rows": Notification.objects.count(),
        "unread": values["count"],
        "exact": values["get_count"] == values["count"],
        "samples": samples,
        "get_count_ms": round(get_count_ms, 4),
        "count_ms": round(count_ms, 4),
        "count_get_count": round(count_ms / get_count_ms, 2),
    }
