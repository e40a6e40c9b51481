from django.contrib import admin

from counters.models import AuditCursor, AuditRepair, FlushBatch


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


@admin.register(AuditRepair)
class AuditRepairAdmin(admin.ModelAdmin):
    list_display = ("repaired_at", "counter", "key", "stored", "buffered", "truth", "delta")
    list_filter = ("counter",)
    search_fields = ("key",)
    date_hierarchy = "repaired_at"

    @admin.display(description="repair")
    def delta(self, obj: AuditRepair) -> str:
        return f"{obj.delta:+d}"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(AuditCursor)
class AuditCursorAdmin(admin.ModelAdmin):
    list_display = (
        "counter",
        "after",
        "checked",
        "sweeps",
        "last_run_at",
        "last_sweep_at",
        "last_sweep_seconds",
    )

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
