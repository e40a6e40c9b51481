"""What a user can do with their own notifications: shared by the pages and the JSON API.

Every change goes through the counted paths of :mod:`notifications.models`, so
the unread badge stays exact. Input is parsed strictly here; a value that does
not parse raises :class:`BadInput`, which the callers turn into a 400.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet

from .models import Notification, NotificationQuerySet, UnreadCounter

#: Largest value of a 64-bit signed primary key.
MAX_ID = 2**63 - 1
#: Deepest page a list can be read at (bounds the OFFSET of a query).
MAX_PAGE = 10_000
MAX_PAGE_SIZE = 100
DEFAULT_PAGE_SIZE = 20

_ID = re.compile(r"[1-9][0-9]{0,18}")


class BadInput(ValueError):
    """A parameter that does not parse; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        self.message = message
        super().__init__(f"{param}: {message}")


def parse_int(raw: str | None, param: str, *, default: int, maximum: int) -> int:
    """A decimal integer from 1 to ``maximum`` (ASCII digits only), or ``default`` if absent."""
    if raw is None:
        return default
    if not _ID.fullmatch(raw) or int(raw) > maximum:
        raise BadInput(param, f"must be an integer from 1 to {maximum}")
    return int(raw)


def parse_id(raw: str, param: str = "id") -> int:
    """A notification id from a URL: a positive 64-bit integer."""
    return parse_int(raw, param, default=0, maximum=MAX_ID)


def parse_bool(raw: str | None, param: str) -> bool | None:
    """``true`` / ``false``, or None if absent."""
    if raw is None:
        return None
    if raw in ("true", "false"):
        return raw == "true"
    raise BadInput(param, "must be true or false")


def own(user: Any) -> NotificationQuerySet:
    """The user's notifications, newest first, with their actor."""
    return Notification.objects.filter(recipient=user).select_related("actor")


def get_own(user: Any, pk: int) -> Notification:
    """The user's notification ``pk``; raises ``DoesNotExist`` also if it is someone else's."""
    return own(user).get(pk=pk)


@dataclass(frozen=True)
class Page:
    items: list[Notification]
    number: int
    size: int
    has_next: bool

    @property
    def has_previous(self) -> bool:
        return self.number > 1


def page_of(qs: QuerySet[Notification], number: int, size: int) -> Page:
    """One page of ``qs``. Reads one row more than the page instead of counting the rows."""
    start = (number - 1) * size
    rows = list(qs[start : start + size + 1])
    return Page(items=rows[:size], number=number, size=size, has_next=len(rows) > size)


def unread_count(user: Any) -> int:
    """Exact unread count (stored + buffered), so a user sees their own change at once."""
    return UnreadCounter.objects.get_count(user)


async def aunread_count(user: Any) -> int:
    """:func:`unread_count` from async code."""
    return await UnreadCounter.objects.aget_count(user)


def mark_all_read(user: Any, until_id: int | None = None) -> int:
    """Mark the user's unread notifications read (only ids up to ``until_id`` if given)."""
    qs = Notification.objects.filter(recipient=user)
    if until_id is not None:
        qs = qs.filter(pk__lte=until_id)
    return qs.mark_all_read()


def newest_id(user: Any) -> int | None:
    """Id of the user's newest notification: the limit for a later "mark all read"."""
    return (
        Notification.objects.filter(recipient=user)
        .order_by("-pk")
        .values_list("pk", flat=True)
        .first()
    )
