"""Notifications and their per-user unread counter.

The unread counter is one ``counters.track()`` declaration (see ``apps.py``):
every ORM path that changes unread state locks the rows, reads what they
were, changes them, and counts the difference. A path that changed nothing
counts nothing, so racing requests never count twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

import counters

from .apps import UNREAD_COUNTER


# django-stubs gives each QuerySet class a generated as_manager(), in the order mypy analyses
# the modules; it may reach this one before CountedQuerySet (which the front imports for type
# checking only), and then sees an override. Nothing is overridden here.
class NotificationQuerySet(counters.CountedQuerySet):  # type: ignore[override, unused-ignore]
    def unread(self) -> NotificationQuerySet:
        return self.filter(is_read=False)

    def read(self) -> NotificationQuerySet:
        return self.filter(is_read=True)

    def for_user(self, user: Any) -> NotificationQuerySet:
        return self.filter(recipient=user)

    def mark_all_read(self) -> int:
        """Mark every unread notification of this queryset read; returns rows changed."""
        return self.filter(is_read=False).update(is_read=True, read_at=timezone.now())

    def mark_all_unread(self) -> int:
        """Mark every read notification of this queryset unread; returns rows changed."""
        return self.filter(is_read=True).update(is_read=False, read_at=None)

    def notify(self, recipients, *, batch_size: int = 1000, **fields: Any) -> int:
        """Create one notification per recipient, in batches; returns how many.

        One transaction: the deltas of all batches add up, so each recipient
        gets one aggregated delta when it commits.
        """
        if batch_size < 1:
            raise ValueError("size must be at least 1")
        total = 0
        remaining = iter(recipients)
        with transaction.atomic(using=self.db):
            while chunk := list(islice(remaining, batch_size)):
                objs = [self.model(recipient_id=getattr(r, "pk", r), **fields) for r in chunk]
                self.bulk_create(objs, batch_size=batch_size)
                total += len(objs)
        return total


NotificationManager = models.Manager.from_queryset(NotificationQuerySet)


class Notification(models.Model):
    recipient = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notifications"
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    verb = models.CharField(max_length=255)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    is_read = models.BooleanField(default=False)
    read_at = models.DateTimeField(null=True, blank=True)

    objects = NotificationManager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(
                fields=["recipient", "-created_at"],
                name="notif_unread_by_recipient",
                condition=models.Q(is_read=False),
            ),
            models.Index(fields=["recipient", "-created_at"], name="notif_by_recipient"),
        ]

    def __str__(self) -> str:
        return f"{self.verb} → {self.recipient_id}"

    def mark_read(self) -> bool:
        """Mark read. True if this call changed the row (exactly one racing call wins)."""
        return self._set_read(True)

    def mark_unread(self) -> bool:
        """Mark unread. True if this call changed the row."""
        return self._set_read(False)

    def _set_read(self, value: bool) -> bool:
        read_at = timezone.now() if value else None
        qs = type(self)._default_manager.using(self._state.db or "default").filter(pk=self.pk)
        changed = qs.filter(is_read=not value).update(is_read=value, read_at=read_at) == 1
        self.is_read = value
        if changed:
            self.read_at = read_at
        return changed


class UnreadCounterManager(models.Manager):
    def get_count(self, user_or_id: Any) -> int:
        """Exact unread count now: the stored row plus buffered deltas.

        Never below 0: the counter is registered ``non_negative``, so a count
        that drift made negative reads 0 and is queued for repair.
        """
        user_id = getattr(user_or_id, "pk", user_or_id)
        return counters.get_value(UNREAD_COUNTER, user_id, using=self.db)

    def get_counts(self, users_or_ids) -> dict[Any, int]:
        """Exact unread counts of several users at once, keyed by user id (never below 0)."""
        ids = [getattr(u, "pk", u) for u in users_or_ids]
        return counters.get_values(UNREAD_COUNTER, ids, using=self.db)

    async def aget_count(self, user_or_id: Any) -> int:
        """:meth:`get_count` from async code (an async view): the same exact count."""
        user_id = getattr(user_or_id, "pk", user_or_id)
        return await counters.aget_value(UNREAD_COUNTER, user_id, using=self.db)

    async def aget_counts(self, users_or_ids) -> dict[Any, int]:
        """:meth:`get_counts` from async code. ``users_or_ids`` is read in the thread that
        reads the counts, so it may be a QuerySet of users."""

        def ids() -> Iterator[Any]:  # a generator function: iterated in the thread alone
            for user in users_or_ids:
                yield getattr(user, "pk", user)

        return await counters.aget_values(UNREAD_COUNTER, ids(), using=self.db)


class UnreadCounter(models.Model):
    """Stored unread count of one user. Changed only by the counters flush."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="unread_counter",
    )
    count = models.BigIntegerField(default=0)

    objects = UnreadCounterManager()

    class Meta:
        verbose_name = "unread counter"

    def __str__(self) -> str:
        return f"{self.user_id}: {self.count}"

    def exact(self) -> int:
        return type(self).objects.get_count(self.user_id)


class DailyCount(models.Model):
    """Notifications a user received per day (in the current time zone).

    The rows of the counter ``daily_notifications``, keyed by ``(recipient,
    created_at__date)``: ``counters.track("daily_notifications", Notification,
    key=("recipient", "created_at__date"), into="notifications.DailyCount.count")``.
    The flush creates them. This example declares no such counter itself (every
    notification written would pay for it); the tests declare it.
    """

    recipient = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+"
    )
    created_at_date = models.DateField()
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["recipient", "created_at_date"], name="daily_count_recipient_day"
            )
        ]

    def __str__(self) -> str:
        return f"{self.recipient_id} on {self.created_at_date}: {self.count}"
