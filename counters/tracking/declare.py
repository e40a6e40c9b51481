"""``counters.track()``: an exact, buffered count (or sum) of the rows of any model.

::

    counters.track("post_comments", Comment, key="post",
                   into="blog.PostStats.comments", where=Q(approved=True))

A row of the source model adds to the counter of its ``key`` its
contribution: 0 unless ``where`` holds, else 1 (or its ``amount``). Every
counted path (see :mod:`counters.tracking.counting` and :mod:`counters.tracking.queryset`)
locks the rows it changes, reads their contributions before and after, and
adds the difference per key. ``track()`` checks the declaration, resolves
its ``into`` target, registers the counter (a
:class:`~counters.base.registry.CounterSpec` on the ``into`` field, with a
truth source for rebuilds) and the tracker, then installs the counted routes
(:func:`~counters.tracking.routes.install_tracked`). A mistake raises
:class:`~counters.base.exceptions.TrackingError`, an ``ImproperlyConfigured``
carrying one of the check ids of :data:`CHECK_IDS`, before anything is registered.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import re
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from django.apps import apps
from django.core.exceptions import FieldDoesNotExist
from django.db import models
from django.db.models import Q

from counters.base import backends, registry
from counters.base.exceptions import TrackedTooEarly, TrackingError, UnknownCounter
from counters.base.utils import concrete_model, related_model, target_field
from counters.buffer.live import make_live
from counters.tracking import keys, m2m, refusals
from counters.tracking.paths import Hop, PathError, resolve
from counters.tracking.routes import install_tracked
from counters.tracking.trackers import QueryTruth, Tracker, add_tracker, find_tracker
from counters.tracking.where import WhereError, compile_where

logger = logging.getLogger(__name__)

#: System check ids of the mistakes ``track()`` refuses.
CHECK_IDS = {
    "counters.E010": "unknown model or field, or a field that is not one column",
    "counters.E011": "a where that cannot be decided from a row's own values",
    "counters.E012": "an amount or a target field that is not an integer field",
    "counters.E013": "a source model whose default manager is not counted",
    "counters.E014": "a counter name already registered with other arguments",
    "counters.E015": "an into model with no key field matching the key",
    "counters.E016": "an invalid counter name, or an unknown or missing keyword",
    "counters.E045": "a base manager (Meta.base_manager_name) that is not counted",
    "counters.E046": "a proxy or multi-table relative whose default manager is not counted",
    "counters.E050": "an into model with a NOT NULL column the flush cannot fill",
    "counters.E051": "a key, amount or where on a generated field",
    "counters.E052": "a source or into model with a composite primary key",
    "counters.E053": "a counter column that already holds another counter",
    "counters.E054": "a key whose values are not values of the into model's key field",
    "counters.E055": "a composite key whose parts cannot be read or stored",
    "counters.E056": "a related key or where through an uncounted model, two relations or a cycle",
    "counters.E057": "a many-to-many through model whose rows Django writes uncounted",
    "counters.E058": "a composite key that several unique constraints of into could store",
}

#: What a counter name may hold: it is part of Redis members, metric labels and URLs.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _keywords_checked(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Arguments that do not fit ``func``'s signature raise a :class:`TrackingError`
    naming the valid keywords (and the closest one), not a bare ``TypeError``."""
    signature = inspect.signature(func)
    valid = [n for n, p in signature.parameters.items() if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(func)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            name = str(args[0] if args else kwargs.get("name", "?"))
            unknown = [k for k in kwargs if k not in signature.parameters]
            problem = str(exc)
            if unknown:
                close = difflib.get_close_matches(unknown[0], valid, n=1)
                problem = f"unknown keyword {unknown[0]!r}" + (
                    f" (did you mean {close[0]!r}?)" if close else ""
                )
            raise TrackingError(
                "counters.E016", name, f"{problem}; the keywords are {', '.join(valid)}"
            ) from None
        return func(*args, **kwargs)

    return checked


@_keywords_checked
def track(
    name: str,
    model: type[models.Model] | str,
    *,
    key: str | tuple[str, ...],
    into: str,
    where: Q | None = None,
    amount: str | None = None,
    live: bool = False,
) -> Tracker:
    """Count the rows of ``model`` per ``key`` into ``into`` (``"app_label.Model.field"``).

    ``key`` is a field, a related path (``"post__author"``,
    ``"post__blog__owner"``: forward foreign keys or one-to-ones, then a column
    of the model they reach; every model in the middle must be counted), or a
    tuple of field paths (a composite key, see :mod:`counters.tracking.keys`).
    ``where`` (a ``Q`` on the model's own fields, or on related paths like
    ``post__published`` along the same relations) picks the rows that count;
    ``amount`` (an integer field) is added instead of 1. A counter without
    ``amount`` is a count of rows and never reads below zero. Call it from
    an ``AppConfig.ready()`` (earlier, :class:`TrackedTooEarly` is raised);
    the same declaration twice is harmless. ``live`` makes the counter watchable
    (:func:`counters.awatch`): the change of each key is published on the key's own
    Redis shard channel, which only the processes watching it subscribe to; a counter
    that is not live costs nothing more. Declare it live in every process
    that writes it (the same ``ready()`` does).
    """
    if not apps.models_ready:  # one clear error, not the registry's own from deep inside
        raise TrackedTooEarly(str(name))
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise TrackingError(
            "counters.E016", str(name), "a name is made of letters, digits, '_', '.' and '-'"
        )
    source = _source_model(name, model)
    through_problem = m2m.refusal(source)
    if through_problem:
        raise TrackingError(m2m.CHECK_ID, name, through_problem)
    m2m.prepare(source)  # an auto-created through model gets a counted manager
    tracker: Tracker
    if isinstance(key, tuple):
        tracker, into_model, value_field = _composite(name, source, key, into, where, amount)
        into_key = tracker.into_keys[0]
    else:
        key, key_field, hops = _key(name, source, key)
        into_model, value_field, into_key = _resolve_into(name, into, key_field)
        tracker = _validate(name, source, key, key_field, into, where, amount, hops)
    for check_id, problem in refusals.refusals(tracker, into_model, into_key, value_field):
        raise TrackingError(check_id, name, problem)
    existing = find_tracker(name)
    if existing is not None:
        if existing.signature == tracker.signature:
            if live:
                make_live(name)
            return existing
        raise TrackingError(
            "counters.E014", name, f"already tracked with other arguments {existing.signature}"
        )
    _register(tracker, into_model, into_key, value_field)
    add_tracker(tracker)
    install_tracked(tracker)
    m2m.install(tracker.model)
    if live:
        make_live(name)
    logger.debug("tracking %s: %s", tracker.name, tracker.signature)
    return tracker


def _composite(
    name: str,
    source: type[models.Model],
    key: tuple,
    into: str,
    where: Q | None,
    amount: str | None,
) -> tuple[keys.CompositeTracker, type[models.Model], models.Field]:
    """The tracker of a composite ``key``, its into model and value field; else raises."""
    into_model, value_field = _into(name, into)
    try:
        parts = keys.parse_parts(source, key)
        stored = keys.into_fields(into_model, parts)
    except keys.KeyProblem as exc:
        raise TrackingError(exc.check_id, name, str(exc)) from None
    plain = _validate(name, source, str(key), parts[0].field, into, where, amount, {})
    if plain.related:
        raise TrackingError(
            keys.CHECK_ID, name, "a composite key counts with a where over the row's own columns"
        )
    attnames = [p.attname for p in parts]
    attnames += [a for a in plain.attnames if a not in attnames]
    tracker = keys.CompositeTracker(
        **{**plain.__dict__, "key": key, "attnames": tuple(attnames)},
        parts=tuple(parts),
        into_keys=tuple(stored),
    )
    return tracker, into_model, value_field


def _resolve_into(
    name: str, into: str, key_field: models.Field
) -> tuple[type[models.Model], models.Field, models.Field]:
    """``(into model, value field, its key field)``: where the counter of ``key`` is stored."""
    into_model, value_field = _into(name, into)
    return into_model, value_field, _into_key(name, into_model, key_field, value_field)


def _validate(
    name: str,
    source: type[models.Model],
    key: str,
    key_field: models.Field,
    into: str,
    where: Q | None,
    amount: str | None,
    hops: dict[str, Hop],
) -> Tracker:
    """The tracker of a declaration whose amount, where and routes can be counted; else raises."""
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
        condition, where_attnames = compile_where(
            source, where, mysql=backends.any_mysql(), hops=hops
        )
    except WhereError as exc:
        check_id = "counters.E010" if exc.unknown_field else "counters.E011"
        raise TrackingError(check_id, name, str(exc)) from None
    manager_problem = refusals.uncounted_manager(source)
    if manager_problem:
        raise TrackingError("counters.E013", name, manager_problem)
    route_problem = refusals.route_refusal(source)
    if route_problem:
        raise TrackingError(route_problem[0], name, route_problem[1])
    links = [hop.link.attname for hop in hops.values()]
    attnames = [key_field.attname] if key not in hops else []
    if amount_field is not None:
        attnames.append(amount_field.attname)
    attnames += sorted((where_attnames | set(links)) - set(attnames))
    return Tracker(
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
        related=tuple(hops.values()),
    )


def _register(
    tracker: Tracker,
    into_model: type[models.Model],
    into_key: models.Field,
    value_field: models.Field,
) -> None:
    """Register the counter of a new ``tracker`` (its truth source for rebuilds); else raises."""
    name = tracker.name
    shared = (
        None if _registered(name) else refusals.shared_column(name, into_model, value_field.name)
    )
    if shared:
        raise TrackingError("counters.E053", name, shared)
    try:
        key_field: str | tuple[str, ...] = into_key.name
        source: registry.TruthSource = QueryTruth(tracker)
        if isinstance(tracker, keys.CompositeTracker):
            key_field = tuple(f.name for f in tracker.into_keys)
            source = keys.CompositeTruth(tracker)
        registry.register(
            name,
            into_model,
            key_field=key_field,
            value_field=value_field.name,
            source=source,
            non_negative=tracker.amount is None,
        )
    except ValueError as exc:
        raise TrackingError("counters.E014", name, str(exc)) from None


def _registered(name: str) -> bool:
    try:
        registry.get_spec(name)
    except UnknownCounter:
        return False
    return True


def _key(
    name: str, source: type[models.Model], key: str
) -> tuple[str, models.Field, dict[str, Hop]]:
    """``(key, the field its values are of, related paths)``: a column, or a related path."""
    if not isinstance(key, str) or "__" not in key:
        return key, _column(name, source, key, "key"), {}
    try:
        hop = resolve(source, key)
    except PathError as exc:
        raise TrackingError("counters.E010", name, f"key {exc}") from None
    return hop.path, hop.field, {hop.path: hop}


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
