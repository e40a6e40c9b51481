from django.contrib import admin

from .models import Notification, UnreadCounter


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    list_display = ("id", "recipient", "verb", "is_read", "created_at")
    list_filter = ("is_read",)
    search_fields = ("verb", "description", "recipient__username")
    raw_id_fields = ("recipient", "actor")
    actions = ("mark_read", "mark_unread")

    @admin.action(description="Mark selected notifications read")
    def mark_read(self, request, queryset):
        changed = queryset.mark_all_read()
        self.message_user(request, f"{changed} notifications marked read.")

    @admin.action(description="Mark selected notifications unread")
    def mark_unread(self, request, queryset):
        changed = queryset.mark_all_unread()
        self.message_user(request, f"{changed} notifications marked unread.")


@admin.register(UnreadCounter)
class UnreadCounterAdmin(admin.ModelAdmin):
    list_display = ("user", "count", "exact_count")
    search_fields = ("user__username",)
    readonly_fields = ("user", "count")

    @admin.display(description="exact (stored + buffered)")
    def exact_count(self, obj: UnreadCounter) -> int:
        return obj.exact()

    def has_add_permission(self, request) -> bool:
        return False
