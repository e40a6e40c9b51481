"""``counters.track()``: an exact, buffered count (or sum) of the rows of any model.

::

    counters.track("post_comments", Comment, key="post",
                   into="blog.PostStats.comments", where=Q(approved=True))

A row of the source model adds to the counter of its ``key`` its
contribution: 0 unless ``where`` holds, else 1 (or its ``amount``). Every
counted path (see :mod:`counters.counting` and :mod:`counters.queryset`)
locks the rows it changes, reads their contributions before and after, and
adds the difference per key. ``track()`` registers the counter (a
:class:`~counters.registry.CounterSpec` on the ``into`` field, with a truth
source for rebuilds) and checks the declaration: a mistake raises
:class:`~counters.exceptions.TrackingError`, an ``ImproperlyConfigured``
carrying one of the check ids of :data:`CHECK_IDS`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.apps import apps
from django.core.exceptions import FieldDoesNotExist
from django.db import models
from django.db.models import Q

from . import declarations, registry
from .exceptions import TrackingError, UnknownCounter
from .utils import concrete_model, related_model, target_field
from .where import Predicate, WhereError, compile_where

logger = logging.getLogger(__name__)

#: System check ids of the mistakes ``track()`` refuses.
CHECK_IDS = {
    "counters.E010": "unknown model or field, or a field that is not one column",
    "counters.E011": "a where that cannot be decided from a row's own values",
    "counters.E012": "an amount or a target field that is not an integer field",
    "counters.E013": "a source model whose default manager is not counted",
    "counters.E014": "a counter name already registered with other arguments",
    "counters.E015": "an into model with no key field matching the key",
    "counters.E016": "an invalid counter name",
    "counters.E045": "a base manager (Meta.base_manager_name) that is not counted",
    "counters.E046": "a proxy or multi-table relative whose default manager is not counted",
    "counters.E050": "an into model with a NOT NULL column the flush cannot fill",
    "counters.E051": "a key, amount or where on a generated field",
    "counters.E052": "a source or into model with a composite primary key",
    "counters.E053": "a counter column that already holds another counter",
    "counters.E054": "a key whose values are not values of the into model's key field",
}

Row = Mapping[str, Any]


@dataclass(frozen=True, eq=False)
class Tracker:
    """One ``track()`` declaration, resolved to fields."""

    name: str
    model: type[models.Model]
    key: str
    into: str
    where: Q | None
    amount: str | None
    key_field: models.Field
    amount_field: models.Field | None
    condition: Predicate
    attnames: tuple[str, ...]

    @property
    def signature(self) -> tuple:
        return (self.model._meta.label, self.key, self.into, self.where, self.amount)

    @property
    def spec(self) -> registry.CounterSpec:
        return registry.get_spec(self.name)

    @property
    def parent_model(self) -> type[models.Model] | None:
        """The model ``key`` points to (its counters exist for each of its rows), else None."""
        remote = self.key_field.remote_field
        return remote.model if remote is not None else None

    def contribution(self, row: Row) -> tuple[Any, int] | None:
        """``(key, what the row adds)``, or None if it adds nothing."""
        key = row[self.key_field.attname]
        if key is None or not self.condition(row):
            return None
        if self.amount_field is None:
            return key, 1
        return key, row[self.amount_field.attname] or 0

    def totals(self, rows: Iterable[Row | None]) -> Counter:
        """What ``rows`` add up to per key (keys normalised: ``"5"`` and ``5`` are one)."""
        normalize = self.spec.normalize
        totals: Counter = Counter()
        for row in rows:
            if row is None:
                continue
            found = self.contribution(row)
            if found is not None and found[1]:
                totals[normalize(found[0])] += found[1]
        return totals

    def deltas(self, old: Iterable[Row | None], new: Iterable[Row | None]) -> dict[Any, int]:
        """``new - old`` per key, zeros left out."""
        change = self.totals(new)
        change.subtract(self.totals(old))
        return {key: delta for key, delta in change.items() if delta}


_trackers: dict[str, Tracker] = {}
_by_model: dict[type[models.Model], tuple[Tracker, ...]] = {}
_fields: dict[type[models.Model], tuple[models.Field, ...]] = {}
_names: dict[type[models.Model], frozenset[str]] = {}


def trackers_for(model: type[models.Model]) -> tuple[Tracker, ...]:
    """The trackers whose source is ``model`` (or the concrete model of a proxy)."""
    return _by_model.get(concrete_model(model), ())


def tracked_fields(model: type[models.Model]) -> tuple[models.Field, ...]:
    """The fields a counted path reads from rows of ``model``, in a fixed order."""
    return _fields.get(concrete_model(model), ())


def touches(model: type[models.Model], names: Iterable[str]) -> bool:
    """Whether changing fields ``names`` (names or attnames) can change a counter."""
    tracked = _names.get(concrete_model(model))
    return tracked is not None and not tracked.isdisjoint(names)


def get_tracker(name: str) -> Tracker:
    return _trackers[name]


def all_trackers() -> list[Tracker]:
    return list(_trackers.values())


def tracked_models() -> tuple[type[models.Model], ...]:
    """The concrete models that have trackers, in the order they were first tracked."""
    return tuple(_by_model)


def track(
    name: str,
    model: type[models.Model] | str,
    *,
    key: str,
    into: str,
    where: Q | None = None,
    amount: str | None = None,
) -> Tracker:
    """Count the rows of ``model`` per ``key`` into ``into`` (``"app_label.Model.field"``).

    ``where`` (a ``Q`` on the model's own fields) picks the rows that count;
    ``amount`` (an integer field) is added instead of 1. A counter without
    ``amount`` is a count of rows and never reads below zero. Call it from
    an ``AppConfig.ready()``; the same declaration twice is harmless.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise TrackingError("counters.E016", str(name), "a name is a non-empty string without ':'")
    source = _source_model(name, model)
    key_field = _column(name, source, key, "key")
    into_model, value_field = _into(name, into)
    into_key = _into_key(name, into_model, key_field, value_field)
    amount_field = None
    if amount is not None:
        amount_field = _column(name, source, amount, "amount")
        if not _is_integer(amount_field):
            raise TrackingError(
                "counters.E012",
                name,
                f"amount {amount!r} is a {amount_field.get_internal_type()}, not an integer field",
            )
    try:
        condition, where_attnames = compile_where(source, where)
    except WhereError as exc:
        check_id = "counters.E010" if exc.unknown_field else "counters.E011"
        raise TrackingError(check_id, name, str(exc)) from None
    manager_problem = uncounted_manager(source)
    if manager_problem:
        raise TrackingError("counters.E013", name, manager_problem)
    from .routes import refusal

    route_problem = refusal(source)
    if route_problem:
        raise TrackingError(route_problem[0], name, route_problem[1])
    attnames = [key_field.attname]
    if amount_field is not None:
        attnames.append(amount_field.attname)
    attnames += sorted(where_attnames - set(attnames))
    tracker = Tracker(
        name=name,
        model=source,
        key=key,
        into=into,
        where=where,
        amount=amount,
        key_field=key_field,
        amount_field=amount_field,
        condition=condition,
        attnames=tuple(attnames),
    )
    for check_id, problem in declarations.refusals(tracker, into_model, into_key, value_field):
        raise TrackingError(check_id, name, problem)
    existing = _trackers.get(name)
    if existing is not None:
        if existing.signature == tracker.signature:
            return existing
        raise TrackingError(
            "counters.E014", name, f"already tracked with other arguments {existing.signature}"
        )
    shared = (
        None
        if _registered(name)
        else declarations.shared_column(name, into_model, value_field.name)
    )
    if shared:
        raise TrackingError("counters.E053", name, shared)
    from .truth import QueryTruth

    try:
        registry.register(
            name,
            into_model,
            key_field=into_key.name,
            value_field=value_field.name,
            source=QueryTruth(tracker),
            non_negative=amount is None,
        )
    except ValueError as exc:
        raise TrackingError("counters.E014", name, str(exc)) from None
    _add(tracker)
    return tracker


def _registered(name: str) -> bool:
    try:
        registry.get_spec(name)
    except UnknownCounter:
        return False
    return True


def _add(tracker: Tracker) -> None:
    from . import counting, routes, signals, tombs

    model = tracker.model
    _trackers[tracker.name] = tracker
    _by_model[model] = (*_by_model.get(model, ()), tracker)
    meta = model._meta
    names = {a for t in _by_model[model] for a in t.attnames}
    fields = tuple(f for f in meta.concrete_fields if f.attname in names)
    _fields[model] = fields
    _names[model] = frozenset({f.name for f in fields} | {f.attname for f in fields})
    counting.install_save(model)
    signals.connect_model(model)
    spec = tracker.spec
    if tombs.reusable(spec) and spec.target_model is not None:
        tombs.connect(spec.target_model)
    for tracked in _by_model:  # a new tracked model may be a relative of the others
        routes.install(tracked)
    logger.debug("tracking %s: %s", tracker.name, tracker.signature)


def uncounted_manager(model: type[models.Model]) -> str | None:
    """Why the default manager of ``model`` does not count its querysets, or None."""
    from .queryset import CountedQuerySet

    manager = model._default_manager
    queryset = manager.get_queryset()
    if isinstance(queryset, CountedQuerySet):
        return None
    return (
        f"the default manager {model.__name__}.{manager.name} makes {type(queryset).__name__} "
        "querysets, whose update(), delete() and bulk_create() are not counted: use "
        "objects = counters.CountedManager() (or a manager of a counters.CountedQuerySet "
        "subclass)"
    )


def _source_model(name: str, model: type[models.Model] | str) -> type[models.Model]:
    if isinstance(model, str):
        try:
            model = apps.get_model(model)
        except (LookupError, ValueError) as exc:
            raise TrackingError("counters.E010", name, f"no model {model!r}: {exc}") from None
    if not (isinstance(model, type) and issubclass(model, models.Model)):
        raise TrackingError("counters.E010", name, f"{model!r} is not a model")
    if model._meta.proxy or model._meta.abstract:
        raise TrackingError(
            "counters.E010", name, f"{model._meta.label} is a proxy or abstract: track its table"
        )
    return model


def _column(name: str, model: type[models.Model], field_name: str, role: str) -> models.Field:
    try:
        field = model._meta.get_field(field_name)
    except FieldDoesNotExist:
        raise TrackingError(
            "counters.E010", name, f"{role} {field_name!r}: {model._meta.label} has no such field"
        ) from None
    if not isinstance(field, models.Field) or not field.concrete or field.many_to_many:
        raise TrackingError(
            "counters.E010", name, f"{role} {field_name!r} is not a column of {model._meta.label}"
        )
    return field


def _into(name: str, into: str) -> tuple[type[models.Model], models.Field]:
    parts = into.split(".") if isinstance(into, str) else []
    if len(parts) != 3:
        raise TrackingError("counters.E010", name, f'into {into!r} must be "app_label.Model.field"')
    label = f"{parts[0]}.{parts[1]}"
    try:
        model = apps.get_model(label)
    except LookupError:
        raise TrackingError("counters.E010", name, f"into {into!r}: no model {label}") from None
    field = _column(name, model, parts[2], "into")
    if not _is_integer(field) or field.primary_key:
        raise TrackingError(
            "counters.E012",
            name,
            f"into {into!r} is a {field.get_internal_type()}, not an integer field to count in",
        )
    return model, field


def _into_key(
    name: str,
    into_model: type[models.Model],
    key_field: models.Field,
    value_field: models.Field,
) -> models.Field:
    """The field of ``into_model`` whose value equals the source ``key``.

    Its primary key, or a unique one-to-one: for a key pointing to model P,
    a relation to P on the same target field; otherwise the primary key.
    """
    meta = into_model._meta
    candidates = [meta.pk] + [
        f for f in meta.concrete_fields if f.unique and not f.primary_key and f is not value_field
    ]
    if key_field.is_relation:
        parent = concrete_model(related_model(key_field))
        for field in candidates:
            if (
                field.is_relation
                and concrete_model(related_model(field)) is parent
                and target_field(field).attname == target_field(key_field).attname
            ):
                return field
        raise TrackingError(
            "counters.E015",
            name,
            f"{meta.label} has no primary key or unique one-to-one field pointing to "
            f"{parent._meta.label} (the model of key {key_field.name!r})",
        )
    return meta.pk


def _is_integer(field: models.Field) -> bool:
    return isinstance(field, models.IntegerField) and not field.is_relation
