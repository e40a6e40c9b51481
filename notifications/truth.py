"""The true unread counts, recomputed from Notification rows (for rebuilds)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db import DEFAULT_DB_ALIAS
from django.db.models import Count

from .models import Notification


class UnreadTruth:
    """Keys are user ids; the truth is ``COUNT(*)`` of their unread notifications."""

    def keys_after(
        self, after: Any | None, limit: int, *, using: str = DEFAULT_DB_ALIAS
    ) -> list[Any]:
        users = get_user_model()._default_manager.using(using).order_by("pk")
        if after is not None:
            users = users.filter(pk__gt=after)
        return list(users.values_list("pk", flat=True)[:limit])

    def count_for(self, keys: list[Any], *, using: str = DEFAULT_DB_ALIAS) -> dict[Any, int]:
        rows = (
            Notification.objects.using(using)
            .filter(recipient_id__in=keys, is_read=False)
            .order_by()
            .values("recipient_id")
            .annotate(n=Count("pk"))
            .values_list("recipient_id", "n")
        )
        return dict(rows)

    def estimate(self, *, using: str = DEFAULT_DB_ALIAS) -> int:
        return get_user_model()._default_manager.using(using).count()
