"""Composite keys of ``track()``: ``key=("recipient", "created__date")``.

Each part is a path over the counted row's own columns: a column (a forward
foreign key by its name, ``"recipient"``, whose value is the id), optionally
ending in Django's ``__date`` transform on a ``DateTimeField``: the date in
the current time zone, ``timezone.localtime(value).date()`` with ``USE_TZ``.

The ``into`` model has one field per part, named as the path with ``__``
written ``_`` (``recipient``; ``created_date`` for ``created__date``), of the
part's kind (a foreign key to the same model, a ``DateField`` for a date),
under one unique constraint over exactly those fields, so that the flush can
create its rows with an upsert. Without fields of those names, the parts go
in order to the fields of the one unique constraint that can store them
(``counters.E058`` if several can). :class:`CompositeTracker` reads a key from a
row, :class:`CompositeTruth` counts the truth with SQL grouped by the parts
(the dates by ``TruncDate`` in the current time zone).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from operator import or_
from typing import Any, ClassVar, cast

from django.conf import settings
from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.models import F, Q
from django.db.models.functions import TruncDate
from django.utils import timezone

from counters.base.keys import CompositeKey, part_type_problem
from counters.base.utils import concrete_model, related_model, target_field
from counters.tracking.trackers import Tracker
from counters.tracking.where import Row

#: The check id of a composite key that cannot be counted or stored.
CHECK_ID = "counters.E055"


class KeyProblem(ValueError):
    """A composite key's problem, as a sentence (raised as ``counters.E055``)."""

    check_id = CHECK_ID


#: The check id of a composite key that several unique constraints of ``into`` could store.
AMBIGUOUS_ID = "counters.E058"


class AmbiguousKey(KeyProblem):
    """Several unique constraints of the ``into`` model can store a composite key's parts."""

    check_id = AMBIGUOUS_ID


@dataclass(frozen=True)
class KeyPart:
    """One part of a composite key: ``path``, read from ``field`` of the counted row."""

    path: str
    field: models.Field
    date: bool  # ``__date``: the field is a DateTimeField, the part its local date

    @property
    def attname(self) -> str:
        return self.field.attname

    @property
    def into_name(self) -> str:
        """The name of the ``into`` model's field that stores this part."""
        return self.path.replace("__", "_")

    def value(self, row: Row) -> Any:
        value = row[self.field.attname]
        if value is None or not self.date:
            return value
        if settings.USE_TZ and timezone.is_aware(value):
            return timezone.localtime(value).date()
        return value.date() if isinstance(value, datetime.datetime) else value

    def expression(self) -> Any:
        """The SQL of this part over the counted rows."""
        if not self.date:
            return F(self.field.attname)
        tz = timezone.get_current_timezone() if settings.USE_TZ else None
        return TruncDate(self.field.attname, tzinfo=tz)


def parse_parts(model: type[models.Model], key: tuple) -> list[KeyPart]:
    """The parts of ``key`` over ``model``'s own columns; raises :class:`KeyProblem`."""
    if len(key) < 2 or not all(isinstance(p, str) and p for p in key):
        raise KeyProblem(f"a composite key is a tuple of two or more field paths, not {key!r}")
    if len(set(key)) != len(key):
        raise KeyProblem(f"key {key!r} names a part twice")
    return [_part(model, path) for path in key]


def _part(model: type[models.Model], path: str) -> KeyPart:
    name, _, transform = path.partition("__")
    if transform not in ("", "date"):
        raise KeyProblem(
            f"key part {path!r}: a part is a column of {model._meta.label}, optionally "
            "with __date; relations are not followed"
        )
    try:
        field = model._meta.get_field(name)
    except FieldDoesNotExist:
        raise KeyProblem(f"key part {path!r}: {model._meta.label} has no field {name!r}") from None
    if not isinstance(field, models.Field) or not field.concrete or field.many_to_many:
        raise KeyProblem(f"key part {path!r} is not a column of {model._meta.label}")
    if transform == "date":
        if not isinstance(field, models.DateTimeField):
            raise KeyProblem(f"key part {path!r}: __date applies to a DateTimeField")
        return KeyPart(path, field, True)
    problem = part_type_problem(field)
    if problem:
        raise KeyProblem(f"key part {path!r}: {problem} (a DateTimeField: add __date)")
    return KeyPart(path, field, False)


def into_fields(into_model: type[models.Model], parts: Sequence[KeyPart]) -> list[models.Field]:
    """The fields of ``into_model`` that store ``parts``, checked; raises :class:`KeyProblem`.

    A part goes to the field named as its path (``__`` written ``_``). If
    ``into_model`` lacks one of those, the parts go, in order, to the fields
    of its one unique constraint of as many fields that can store them
    (``UniqueConstraint(fields=["author", "day"])`` for ``("author",
    "at__date")``); two such constraints are refused (:class:`AmbiguousKey`).
    """
    names = {f.name for f in into_model._meta.get_fields()}
    if not all(part.into_name in names for part in parts):
        fitting = [
            fields
            for fields in _unique_sets(into_model)
            if len(fields) == len(parts)
            and all(
                _mismatch(part, cast(models.Field, into_model._meta.get_field(name))) is None
                for part, name in zip(parts, fields, strict=True)
            )
        ]
        if len(fitting) > 1:
            raise AmbiguousKey(
                f"{into_model._meta.label} has no fields named as the key parts "
                f"({', '.join(p.into_name for p in parts)}) and several unique constraints "
                f"that can store them in order: {', '.join(map(str, fitting))}; keep one, "
                "or name the fields as the parts"
            )
        if fitting:
            return [cast(models.Field, into_model._meta.get_field(n)) for n in fitting[0]]
    label = into_model._meta.label
    found: list[models.Field] = []
    for part in parts:
        try:
            field = into_model._meta.get_field(part.into_name)
        except FieldDoesNotExist:
            raise KeyProblem(
                f"{label} has no field {part.into_name!r} to store key part {part.path!r} "
                "(a part is stored in the field named as its path, '__' written '_', or, "
                "in order, in the fields of a unique constraint that can store the parts)"
            ) from None
        problem = _mismatch(part, cast(models.Field, field))
        if problem:
            raise KeyProblem(
                f"{label}.{part.into_name} cannot store key part {part.path!r}: {problem}"
            )
        found.append(cast(models.Field, field))
    names = {f.name for f in found}
    if not any(set(fields) == names for fields in _unique_sets(into_model)):
        raise KeyProblem(
            f"{label} has no unique constraint over exactly ({', '.join(sorted(names))}): "
            "the flush creates and finds counter rows by it; add "
            f"UniqueConstraint(fields=[...], name=...) without a condition"
        )
    return found


def _mismatch(part: KeyPart, field: models.Field) -> str | None:
    if not isinstance(field, models.Field) or not field.concrete or field.many_to_many:
        return "it is not a column"
    if part.date:
        if isinstance(field, models.DateTimeField) or not isinstance(field, models.DateField):
            return "a __date part is stored in a DateField"
        return None
    if part.field.is_relation:
        parent = concrete_model(related_model(part.field))
        if not field.is_relation or concrete_model(related_model(field)) is not parent:
            return f"it is not a foreign key to {parent._meta.label}"
        if target_field(field).attname != target_field(part.field).attname:
            return "it points to another field of the same model"
        return None
    if field.is_relation or _kind(field) != _kind(part.field):
        return f"it holds {_kind(field)} values, the part {_kind(part.field)} values"
    return None


def _kind(field: models.Field) -> str:
    target = target_field(field) if field.is_relation else field
    kinds = (
        (models.DateTimeField, "datetime"),
        (models.IntegerField, "integer"),
        (models.CharField, "text"),
        (models.DateField, "date"),
        (models.UUIDField, "uuid"),
    )
    return next((name for kind, name in kinds if isinstance(target, kind)), "other")


def _unique_sets(model: type[models.Model]) -> list[tuple[str, ...]]:
    meta = model._meta
    sets = [tuple(fields) for fields in meta.unique_together]
    sets += [
        tuple(c.fields)
        for c in meta.total_unique_constraints  # without a condition
        if c.fields and not c.expressions
    ]
    return sets


@dataclass(frozen=True, eq=False)
class CompositeTracker(Tracker):
    """A tracker whose key is a tuple of ``parts`` (``key_field``: the first part's field)."""

    plannable: ClassVar[bool] = False  # a key of several parts: counted from its row

    parts: tuple[KeyPart, ...] = ()
    into_keys: tuple[models.Field, ...] = ()

    @property
    def parent_model(self) -> type[models.Model] | None:
        return None  # counter rows are not one per parent row

    def contribution(self, row: Row) -> tuple[Any, int] | None:
        key = tuple(part.value(row) for part in self.parts)
        if None in key or not self.condition(row):
            return None
        return key, self.adds(row)


class CompositeTruth:
    """The truth of a composite counter: SQL grouped by the key's parts, in key order."""

    def __init__(self, tracker: CompositeTracker) -> None:
        self.tracker = tracker

    def __repr__(self) -> str:
        return f"CompositeTruth({self.tracker.name!r})"

    def _parts(self, using: str) -> models.QuerySet:
        """The counted rows with their key parts as ``k0``, ``k1``, … (no part NULL)."""
        if any(part.date for part in self.tracker.parts):
            _check_zones(using)
        rows: models.QuerySet[Any, Any] = models.QuerySet(self.tracker.model, using=using)
        names = {f"k{i}": part.expression() for i, part in enumerate(self.tracker.parts)}
        rows = rows.annotate(**names)
        return rows.filter(**{f"{name}__isnull": False for name in names})

    def _names(self, model_fields: Sequence[str] | None = None) -> list[str]:
        return list(model_fields or [f"k{i}" for i in range(len(self.tracker.parts))])

    def keys_after(
        self, after: Any | None, limit: int, *, using: str = DEFAULT_DB_ALIAS
    ) -> list[Any]:
        spec = self.tracker.spec
        found = set(self._page(self._parts(using), self._names(), after, limit))
        stored = [f.attname for f in self.tracker.into_keys]
        counted: models.QuerySet[Any, Any] = models.QuerySet(spec.model, using=using)
        found.update(self._page(counted, stored, after, limit))
        return sorted(found)[:limit]

    def _page(self, rows: models.QuerySet, names: list[str], after: Any, limit: int) -> list:
        if after is not None:
            rows = rows.filter(_after(names, spec_key(self.tracker, after)))
        rows = rows.order_by(*names).values_list(*names).distinct()[:limit]
        normalize = self.tracker.spec.normalize
        return [normalize(tuple(row)) for row in rows]

    def count_for(self, keys: list[Any], *, using: str = DEFAULT_DB_ALIAS) -> dict[Any, int]:
        tracker = self.tracker
        if not keys:
            return {}
        wanted = {tracker.spec.normalize(key) for key in keys}
        names = self._names()
        rows = self._parts(using).filter(
            **{f"{name}__in": sorted({key[i] for key in wanted}) for i, name in enumerate(names)}
        )
        grouped = tracker.grouped_totals(rows, names)
        normalize = tracker.spec.normalize
        found = {normalize(tuple(row[:-1])): int(row[-1] or 0) for row in grouped}
        return {key: n for key, n in found.items() if key in wanted}

    def estimate(self, *, using: str = DEFAULT_DB_ALIAS) -> int:
        return self._parts(using).values(*self._names()).distinct().count()


def _check_zones(using: str) -> None:
    """MySQL and MariaDB convert to a named time zone only with their time zone tables
    loaded; without them the day of every row would be NULL: raise instead."""
    conn = connections[using]
    if conn.vendor != "mysql" or not settings.USE_TZ:
        return
    zone = timezone.get_current_timezone_name()
    if zone == conn.timezone_name:
        return  # no conversion: the connection's own zone
    with conn.cursor() as cursor:
        cursor.execute("SELECT CONVERT_TZ('2000-01-01 00:00:00', 'UTC', %s)", [zone])
        (converted,) = cursor.fetchone()
    if converted is None:
        raise ImproperlyConfigured(
            f"the database {using!r} cannot convert times to time zone {zone!r}: the truth "
            "of a key part ending in __date needs the server's time zone tables "
            "(mysql_tzinfo_to_sql /usr/share/zoneinfo | mysql -u root mysql)"
        )


def spec_key(tracker: Tracker, key: Any) -> CompositeKey:
    return tracker.spec.normalize(key)


def _after(names: list[str], key: Sequence[Any]) -> Q:
    """Rows whose ``names`` come after ``key`` in tuple order."""
    alternatives = []
    for i, name in enumerate(names):
        same = {n: key[j] for j, n in enumerate(names[:i])}
        alternatives.append(Q(**same, **{f"{name}__gt": key[i]}))
    return reduce(or_, alternatives)
