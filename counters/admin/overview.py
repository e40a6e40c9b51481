"""The admin's page of every declared counter with its state (``Counters > Counter states``).

One row per counter (:func:`counters.ops.overview.overview`): where it is stored, its rows,
its keys pending and in flight in Redis and their lag, its quarantined deltas, whether it
is backfilling, its audit's last run and repairs; above them, the last flush and what
schedules the flush and the audit. Read-only: the commands and the actions change things.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db import router
from django.http import HttpRequest
from django.template.response import TemplateResponse

from counters.admin.counter import ReadOnly
from counters.client import get_buffer
from counters.models import CounterState
from counters.ops.overview import overview


@admin.register(CounterState)
class CounterStateAdmin(ReadOnly, admin.ModelAdmin):
    """Every declared counter with its state; a page of its own, not a list of rows."""

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> TemplateResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        using = router.db_for_read(CounterState)
        context = {
            **self.admin_site.each_context(request),
            "title": "Counters",
            "subtitle": None,
            "opts": self.model._meta,
            "data": overview(get_buffer(using), using),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/counters/overview.html", context)
