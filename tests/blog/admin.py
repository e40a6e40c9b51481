"""The blog's counter rows in the admin through the library's ``CounterAdmin``."""

from django.contrib import admin

from counters.admin import CounterAdmin

from .models import PostStats


@admin.register(PostStats)
class PostStatsAdmin(CounterAdmin):
    list_display = ("post",)
    rebuild_confirm_delay = 0.2
