"""Repair the unread counters of chosen users from ``COUNT(*)`` truth."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import transaction
from django.db.models import Count

import counters

from .apps import UNREAD_COUNTER
from .models import Notification, UnreadCounter


def truth_counts(user_ids: Iterable[Any]) -> dict[Any, int]:
    """``COUNT(*)`` of unread notifications per user (0 for users with none)."""
    ids = list(user_ids)
    rows = (
        Notification.objects.filter(recipient_id__in=ids, is_read=False)
        .order_by()
        .values("recipient_id")
        .annotate(n=Count("pk"))
        .values_list("recipient_id", "n")
    )
    found = dict(rows)
    return {pk: found.get(pk, 0) for pk in ids}


def repair_users(user_ids: Iterable[Any]) -> list[tuple[Any, int, int]]:
    """Bring each user's exact count to the truth; returns ``(user_id, exact_before, truth)``.

    The difference goes through the normal delta path (sent after COMMIT and
    applied by the flush), so writers and flushers can keep running.
    """
    ids = list(dict.fromkeys(user_ids))
    with transaction.atomic():
        truth = truth_counts(ids)
        exact = UnreadCounter.objects.get_counts(ids)
        deltas = {pk: truth[pk] - exact[pk] for pk in ids if truth[pk] != exact[pk]}
        if deltas:
            counters.add_many(UNREAD_COUNTER, deltas)
    return [(pk, exact[pk], truth[pk]) for pk in ids]
