"""``CounterAdmin``: a ``ModelAdmin`` for the rows a counter is stored in (a ``track(into=...)``
model), with each counter field's stored, pending, exact and true value.

::

    from counters.admin import CounterAdmin

    @admin.register(PostStats)
    class PostStatsAdmin(CounterAdmin):
        list_display = ("post",)          # the counter columns are added after these

Per counter field of the model: *stored* (the row), *pending* (buffered in Redis: pending,
in flight and quarantined), *exact* (their sum, what ``counters.get_value`` reads), *truth*
(``COUNT``/``SUM`` of the counted rows in SQL) and *in sync* (exact equals truth). The
buffer is read once per counter for the page shown, and the truth is counted for that
page's rows only (or the one row of the detail page), never for the whole table. A filter
per counter field picks stored values below, at or above zero; the *rebuild selected*
action repairs the selected rows through :func:`counters.rebuild`: a difference seen the
same several times is repaired through the delta path, so writers and flushers keep running.
Rows change only through counting: there is no add, change or delete here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import ImproperlyConfigured
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest

from counters.base.exceptions import CountersError
from counters.base.registry import CounterSpec, all_specs
from counters.read.values import get_parts
from counters.verify.rebuild import rebuild

#: The columns of each counter field, in order: (part, header).
PARTS = (
    ("stored", "stored"),
    ("pending", "pending (buffered)"),
    ("exact", "exact (stored + pending)"),
    ("truth", "truth (SQL)"),
    ("in_sync", "in sync"),
)

#: Where one request's readings of a row are kept: {counter name: (stored, buffered, truth)}.
READINGS = "_counter_readings"


def row_key(spec: CounterSpec, obj: models.Model) -> Any:
    """The counter key a row of ``spec``'s model stores (a tuple for a composite key)."""
    if spec.codec is not None:
        return tuple(getattr(obj, f.attname) for f in spec.codec.fields)
    return getattr(obj, spec.key_attname)


def read(specs: Sequence[CounterSpec], rows: Sequence[models.Model], using: str) -> None:
    """Read stored + buffered (one read per counter) and the truth of ``rows`` only.

    A row whose buffer cannot be read (Redis down) gets None for it; one without a truth
    source (a ``register()``ed counter) None for the truth.
    """
    for spec in specs:
        keys = [row_key(spec, obj) for obj in rows]
        try:
            parts: dict[Any, tuple[int, int]] | None = get_parts(spec.name, keys, using=using)
        except CountersError:  # Redis unreachable, or no consistent reading: shown as unknown
            parts = None
        truth = spec.source.count_for(keys, using=using) if spec.source is not None else None
        for obj, key in zip(rows, keys, strict=True):
            stored = getattr(obj, spec.value_field)
            buffered = None if parts is None else parts[key][1]
            true = None if truth is None else truth.get(spec.normalize(key), 0)
            obj.__dict__.setdefault(READINGS, {})[spec.name] = (stored, buffered, true)


class CounterChangeList(ChangeList):
    """Reads the counters of the page shown at once, not one row at a time."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        model_admin: CounterAdmin = self.model_admin  # type: ignore[assignment]
        read(model_admin.counter_specs(), list(self.result_list), self.queryset.db)


def _column(admin_: CounterAdmin, spec: CounterSpec, part: str, header: str) -> Callable:
    def reading(obj: models.Model) -> tuple[int, int | None, int | None]:
        if spec.name not in obj.__dict__.get(READINGS, {}):
            read([spec], [obj], obj._state.db or "default")  # the detail page: this row
        return obj.__dict__[READINGS][spec.name]

    def value(obj: models.Model) -> Any:
        stored, buffered, truth = reading(obj)
        exact = None if buffered is None else stored + buffered
        if part == "in_sync":
            return None if exact is None or truth is None else exact == truth
        return {"stored": stored, "pending": buffered, "exact": exact, "truth": truth}[part]

    value.__name__ = f"{spec.value_field}_{part}"
    several = len(admin_.counter_specs()) > 1
    description = f"{spec.value_field} {header}" if several else header
    ordering = spec.value_field if part == "stored" else None
    return admin.display(description=description, boolean=part == "in_sync", ordering=ordering)(
        value
    )


def _sign_filter(spec: CounterSpec) -> type[admin.SimpleListFilter]:
    """A filter of the stored value of ``spec``: below, at or above zero."""
    field = spec.value_field

    def lookups(self: Any, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("neg", "below 0"), ("zero", "0"), ("pos", "above 0")]

    def queryset(self: Any, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        lookup = {"neg": "lt", "zero": "exact", "pos": "gt"}.get(self.value() or "")
        return queryset.filter(**{f"{field}__{lookup}": 0}) if lookup else queryset

    return type(
        f"{field.title()}SignFilter",
        (admin.SimpleListFilter,),
        {
            "title": f"{field} (stored)",
            "parameter_name": f"{field}_sign",
            "lookups": lookups,
            "queryset": queryset,
        },
    )


class ReadOnly:
    """A ``ModelAdmin`` mixin: rows change only through the flush, never by hand here."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class CounterAdmin(ReadOnly, admin.ModelAdmin):
    """The admin of a model that holds counter fields (see the module's docstring).

    ``counters``: the names of the counters shown (default: every counter stored in this
    model); ``rebuild_confirm_delay``: seconds between the readings of a suspect row in
    the rebuild action (default: the rebuild's own).
    """

    counters: Sequence[str] | None = None
    rebuild_confirm_delay: float | None = None
    actions = ("rebuild_selected",)
    show_full_result_count = False

    def counter_specs(self) -> list[CounterSpec]:
        """The counters stored in this model (or those named by ``counters``)."""
        label = self.model._meta.label_lower
        specs = [s for s in all_specs() if s.model_label.lower() == label]
        if self.counters is not None:
            specs = [s for s in specs if s.name in self.counters]
        if not specs:
            raise ImproperlyConfigured(
                f"{type(self).__name__}: no counter is stored in {self.model._meta.label} "
                "(declare one with counters.track(..., into=...))"
            )
        return specs

    def counter_columns(self) -> list[Callable]:
        key = tuple(s.name for s in self.counter_specs())
        cached = self.__dict__.get("_columns")
        if cached is None or cached[0] != key:
            columns = [
                _column(self, spec, part, header)
                for spec in self.counter_specs()
                for part, header in PARTS
            ]
            self.__dict__["_columns"] = cached = (key, columns)
        return cached[1]

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        return [*super().get_list_display(request), *self.counter_columns()]

    def get_list_filter(self, request: HttpRequest) -> list[Any]:
        filters = [_sign_filter(spec) for spec in self.counter_specs()]
        return [*super().get_list_filter(request), *filters]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        fields = [f.name for f in self.model._meta.fields]
        return [*fields, *super().get_readonly_fields(request, obj), *self.counter_columns()]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return CounterChangeList

    @admin.action(description="Rebuild selected counters from their truth", permissions=["rebuild"])
    def rebuild_selected(self, request: HttpRequest, queryset: QuerySet) -> None:
        rows = list(queryset)
        done, wrong, unstable = 0, [], 0
        try:
            for spec in self.counter_specs():
                if spec.source is None:
                    continue
                report = rebuild(
                    spec.name,
                    keys=[row_key(spec, obj) for obj in rows],
                    confirm_delay=self.rebuild_confirm_delay,
                    using=queryset.db,
                )
                done += report.checked
                wrong += [(spec.name, d) for d in report.wrong]
                unstable += len(report.unstable)
        except CountersError as exc:  # a rebuild or audit runs, Redis is down ...
            self.message_user(request, f"Rebuild stopped: {exc}", messages.ERROR)
            return
        text = f"{done} {'counter' if done == 1 else 'counters'} checked; " + (
            f"{len(wrong)} repaired ("
            + ", ".join(f"{n} {d.key}: {d.stored + d.pending} → {d.truth}" for n, d in wrong)
            + ")"
            if wrong
            else "all were exact"
        )
        if unstable:
            text += f"; {unstable} kept changing, run it again to check them"
        level = messages.WARNING if wrong or unstable else messages.SUCCESS
        self.message_user(request, text + ".", level)

    def has_rebuild_permission(self, request: HttpRequest) -> bool:
        opts = self.model._meta
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")
