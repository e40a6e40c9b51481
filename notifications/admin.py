"""Admin for notifications and unread counters. Every change goes through a counted path."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest

from .models import Notification, NotificationQuerySet, UnreadCounter
from .repair import repair_users, truth_counts


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    list_display = ("id", "recipient", "actor", "verb", "is_read", "created_at", "read_at")
    list_filter = ("is_read", "created_at", "read_at")
    search_fields = ("verb", "description", "recipient__username", "actor__username")
    search_help_text = "Search by verb, description, recipient or actor username."
    list_select_related = ("recipient", "actor")
    raw_id_fields = ("recipient", "actor")
    readonly_fields = ("read_at",)
    show_full_result_count = False
    actions = ("mark_read", "mark_unread")

    # delete_selected (queryset.delete()), the change form (save()) and the
    # delete view (delete()) use the counted paths of the model and queryset.

    @admin.action(description="Mark selected notifications read")
    def mark_read(self, request: HttpRequest, queryset: NotificationQuerySet) -> None:
        changed = queryset.mark_all_read()
        self.message_user(request, f"{changed} notifications marked read.", messages.SUCCESS)

    @admin.action(description="Mark selected notifications unread")
    def mark_unread(self, request: HttpRequest, queryset: NotificationQuerySet) -> None:
        changed = queryset.mark_all_unread()
        self.message_user(request, f"{changed} notifications marked unread.", messages.SUCCESS)


class CounterChangeList(ChangeList):
    """Reads exact values and truth for a whole page at once, not one row at a time."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        ids = [obj.pk for obj in self.result_list]
        exact = UnreadCounter.objects.get_counts(ids)
        truth = truth_counts(ids)
        for obj in self.result_list:
            obj.exact_value = exact[obj.pk]
            obj.truth_value = truth[obj.pk]


@admin.register(UnreadCounter)
class UnreadCounterAdmin(admin.ModelAdmin):
    list_display = ("user", "stored", "pending", "exact", "truth", "in_sync")
    list_select_related = ("user",)
    search_fields = ("user__username",)
    search_help_text = "Search by username."
    fields = ("user", "stored", "pending", "exact", "truth")
    readonly_fields = fields
    actions = ("rebuild",)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return CounterChangeList

    def _exact(self, obj: UnreadCounter) -> int:
        cached = obj.__dict__  # one reading per row and request
        if "exact_value" not in cached:
            cached["exact_value"] = obj.exact()
        return int(cached["exact_value"])

    def _truth(self, obj: UnreadCounter) -> int:
        cached = obj.__dict__
        if "truth_value" not in cached:
            cached["truth_value"] = truth_counts([obj.pk])[obj.pk]
        return int(cached["truth_value"])

    @admin.display(description="stored", ordering="count")
    def stored(self, obj: UnreadCounter) -> int:
        return obj.count

    @admin.display(description="pending (buffered)")
    def pending(self, obj: UnreadCounter) -> int:
        return self._exact(obj) - obj.count

    @admin.display(description="exact (stored + pending)")
    def exact(self, obj: UnreadCounter) -> int:
        return self._exact(obj)

    @admin.display(description="truth (COUNT)")
    def truth(self, obj: UnreadCounter) -> int:
        return self._truth(obj)

    @admin.display(description="in sync", boolean=True)
    def in_sync(self, obj: UnreadCounter) -> bool:
        return self._exact(obj) == self._truth(obj)

    @admin.action(
        description="Rebuild selected counters from the notifications",
        permissions=["rebuild"],
    )
    def rebuild(self, request: HttpRequest, queryset: QuerySet[UnreadCounter]) -> None:
        results = repair_users(queryset.values_list("pk", flat=True))
        wrong = [(pk, before, truth) for pk, before, truth in results if before != truth]
        if not wrong:
            self.message_user(request, f"{len(results)} counters checked; all were exact.")
            return
        details = ", ".join(f"user {pk}: {before} → {truth}" for pk, before, truth in wrong)
        self.message_user(
            request,
            f"{len(results)} counters checked; {len(wrong)} repaired ({details}).",
            messages.WARNING,
        )

    def has_rebuild_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("notifications.change_unreadcounter")

    # Rows change only through the flush: no adding, editing or deleting here.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
