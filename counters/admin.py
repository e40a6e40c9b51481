from django.contrib import admin

from .models import FlushBatch


@admin.register(FlushBatch)
class FlushBatchAdmin(admin.ModelAdmin):
    list_display = ("batch_id", "kind", "shard", "keys", "deltas", "dropped", "applied_at")
    list_filter = ("kind", "shard")
    search_fields = ("batch_id",)
    date_hierarchy = "applied_at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
