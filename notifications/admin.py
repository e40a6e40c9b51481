"""Admin for notifications and unread counters. Every change goes through a counted path."""

from __future__ import annotations

from django.contrib import admin, messages
from django.http import HttpRequest

from counters.admin import CounterAdmin

from .models import Notification, NotificationQuerySet, UnreadCounter


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


@admin.register(UnreadCounter)
class UnreadCounterAdmin(CounterAdmin):
    """Stored, pending, exact, truth and in-sync columns and the rebuild action: the
    library's :class:`~counters.admin.CounterAdmin`, with the user searchable."""

    list_display = ("user",)
    list_select_related = ("user",)
    search_fields = ("user__username",)
    search_help_text = "Search by username."
    #: Seconds between the readings that confirm a drift (see counters.rebuild).
    rebuild_confirm_delay = 0.5
