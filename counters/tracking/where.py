"""A tracked counter's ``where``, decided in Python from one row's own values.

Only lookups whose Python answer is the database's answer are accepted:
``exact``, ``in`` and ``isnull`` on fields compared by value, and ``gt``,
``gte``, ``lt``, ``lte`` on numbers, dates and times (text is left out: its
order is the database collation's; on MySQL and MariaDB, so is its equality,
unless the collation is binary: see :func:`compile_where`). ``&``, ``|``, ``^`` and ``~`` combine
them. A lookup with ``None`` or on NULL is false, as in SQL; under ``~``
Django makes every comparison two-valued, and so does Python. An expression
(``F("a")``) cannot be decided from the row's values and is refused by
:func:`compile_where`; so is a path through relations (``post__published``,
``post__blog__public``) unless the caller accepts related paths
(:mod:`counters.tracking.paths`): the row then carries the related value
under the path's name.

Values are compared as Python values of their field (:func:`python_value`):
the values a row read from the database has, and the values an instance
would be saved with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import FieldDoesNotExist
from django.db import models
from django.db.models import Q
from django.utils import timezone

from counters.base.utils import target_field
from counters.tracking.paths import Hop, PathError, resolve

Row = Mapping[str, Any]
Predicate = Callable[[Row], bool]
#: Related paths accepted in a where, and where they are collected (None: refused).
Hops = dict[str, Hop] | None

_INTEGERS = {
    "AutoField",
    "BigAutoField",
    "SmallAutoField",
    "IntegerField",
    "BigIntegerField",
    "SmallIntegerField",
    "PositiveIntegerField",
    "PositiveBigIntegerField",
    "PositiveSmallIntegerField",
}
#: Field types ordered the same way in Python and in SQL.
ORDERED = _INTEGERS | {"FloatField", "DateField", "DateTimeField", "TimeField", "DurationField"}
#: Field types equal in Python exactly when they are equal in SQL.
COMPARABLE = ORDERED | {
    "BooleanField",
    "CharField",
    "TextField",
    "SlugField",
    "UUIDField",
    "ForeignKey",
    "OneToOneField",
}
LOOKUPS = {"exact", "in", "isnull", "gt", "gte", "lt", "lte"}


class WhereError(ValueError):
    """``where`` cannot be decided from a row's own values; ``unknown_field`` if a name is wrong."""

    def __init__(self, message: str, *, unknown_field: bool = False) -> None:
        self.unknown_field = unknown_field
        super().__init__(message)


#: Types of plain values: never expressions (``hasattr`` on them raises inside, slowly).
PLAIN_TYPES = frozenset({int, str, bool, float, type(None)})


def is_expression(value: Any) -> bool:
    return type(value) not in PLAIN_TYPES and hasattr(value, "resolve_expression")


#: field -> the type whose values ``field.to_python()`` returns unchanged (None: ask it).
_native: dict[models.Field, type | None] = {}


def native_type(field: models.Field) -> type | None:
    """The type whose values ``field.to_python()`` returns unchanged, or None (ask it)."""
    target = target_field(field) if field.is_relation else field
    kind = target.get_internal_type()
    if kind in _INTEGERS:
        return int
    if kind == "BooleanField":
        return bool
    if kind in {"CharField", "TextField", "SlugField"}:
        return str
    return None


def python_value(field: models.Field, value: Any) -> Any:
    """``value`` as the Python value ``field`` stores (an instance is its key)."""
    if value is None:
        return None
    try:
        native = _native[field]
    except KeyError:
        native = _native[field] = native_type(field)
    if type(value) is native:  # an int of an integer field, a bool, a str: as it is
        return value
    if field.is_relation and isinstance(value, models.Model):
        value = getattr(value, target_field(field).attname)
    value = field.to_python(value)
    if (
        isinstance(value, datetime)
        and settings.USE_TZ
        and field.get_internal_type() == "DateTimeField"
        and timezone.is_naive(value)
    ):
        value = timezone.make_aware(value, timezone.get_default_timezone())
    return value


#: Text kinds: compared by the column's collation on MySQL and MariaDB.
TEXT = {"CharField", "TextField", "SlugField"}


def compile_where(
    model: type[models.Model], where: Q | None, *, mysql: bool = False, hops: Hops = None
) -> tuple[Predicate, set[str]]:
    """A predicate over ``{attname: value}`` rows, and the attnames it reads.

    ``mysql``: the rows may be in MySQL or MariaDB, whose answer differs from
    Python's in two places, both refused: text compared under a collation
    other than a binary NO PAD one (``'a' = 'A' = 'a '`` by default), and
    ``^`` over a nullable column (MySQL's own XOR is NULL when an operand
    is; Django's emulation elsewhere reads NULL as false, as Python does).
    """
    if where is None:
        return (lambda row: True), set()
    if not isinstance(where, Q):
        raise WhereError(f"where must be a Q object, not {type(where).__name__}")
    attnames: set[str] = set()
    predicate = _node(model, where, attnames, mysql, hops)
    return predicate, attnames - set(hops or ())


def _node(
    model: type[models.Model], q: Q, attnames: set[str], mysql: bool, hops: Hops
) -> Predicate:
    read: set[str] = set()
    parts = [
        _node(model, child, read, mysql, hops)
        if isinstance(child, Q)
        else _leaf(model, child, read, mysql, hops)
        for child in q.children
    ]
    attnames |= read
    if q.connector == Q.XOR and mysql:
        nullable = sorted(
            f.name for f in model._meta.concrete_fields if f.attname in read and f.null
        )
        nullable += sorted(  # a related path is NULL if a relation on its way is
            hop.path
            for hop in (hops or {}).values()
            if hop.path in read and any(f.null for f in (*hop.links, hop.field))
        )
        if nullable:
            raise WhereError(
                f"where {q}: ^ over the nullable {', '.join(nullable)} is NULL on MySQL "
                "and MariaDB when a value is NULL, which Python cannot follow (write it "
                "with &, | and ~)"
            )
    if len(parts) == 1 and q.connector != Q.XOR:
        (test,) = parts
    elif q.connector == Q.OR:

        def test(row: Row) -> bool:
            return any(p(row) for p in parts)
    elif q.connector == Q.XOR:

        def test(row: Row) -> bool:
            return sum(1 for p in parts if p(row)) % 2 == 1
    else:

        def test(row: Row) -> bool:
            return all(p(row) for p in parts)

    if q.negated:
        return lambda row: not test(row)
    return test


def _leaf(
    model: type[models.Model], child: Any, attnames: set[str], mysql: bool, hops: Hops
) -> Predicate:
    if not (isinstance(child, tuple) and len(child) == 2 and isinstance(child[0], str)):
        raise WhereError(f"{child!r} is not a field lookup")
    path, value = child
    field, attname, lookup = _lookup(model, path, hops)
    kind = field.get_internal_type()
    allowed = ORDERED if lookup in {"gt", "gte", "lt", "lte"} else COMPARABLE
    if lookup != "isnull" and kind not in allowed:
        raise WhereError(
            f"where {path!r}: {lookup!r} on a {kind} may not give the database's answer in Python"
        )
    if mysql and kind in TEXT and lookup != "isnull" and not _exact_collation(field):
        raise WhereError(
            f"where {path!r}: MySQL and MariaDB compare text by the column's collation "
            "('a' = 'A' = 'a ' by default), Python exactly: give the field a binary NO PAD "
            "db_collation (utf8mb4_0900_bin on MySQL, utf8mb4_nopad_bin on MariaDB)"
        )
    if is_expression(value) or (
        lookup == "in" and not isinstance(value, str) and any(map(is_expression, _items(value)))
    ):
        raise WhereError(
            f"where {path!r} compares with an expression: only constants can be decided "
            "from a row's own values"
        )
    attnames.add(attname)
    if lookup == "isnull" or (lookup == "exact" and value is None):
        wanted = True if lookup == "exact" else value
        if not isinstance(wanted, bool):
            raise WhereError(f"where {path!r}: isnull takes True or False")
        return lambda row: (row[attname] is None) is wanted
    try:
        if lookup == "in":
            options = {python_value(field, v) for v in _items(value)} - {None}
            return lambda row: row[attname] is not None and row[attname] in options
        target = python_value(field, value)
    except Exception as exc:
        raise WhereError(f"where {path!r}: {value!r} is not a value of that field ({exc})") from exc
    if lookup == "exact" and type(target) in PLAIN_TYPES:
        # None equals no value of these types: the test of NULL is the comparison's own
        return lambda row: row[attname] == target
    compare = _COMPARE[lookup]
    return lambda row: row[attname] is not None and compare(row[attname], target)


def _lookup(model: type[models.Model], path: str, hops: Hops) -> tuple[models.Field, str, str]:
    """``(field, its name in a row, lookup)`` of ``path``: a column, or a related one."""
    parts = path.split("__")
    name = parts[0]
    try:
        found = model._meta.get_field(name)
    except FieldDoesNotExist:
        raise WhereError(
            f"{model._meta.label} has no field {name!r} (in where {path!r})", unknown_field=True
        ) from None
    if not isinstance(found, models.Field) or not found.concrete or found.many_to_many:
        raise WhereError(f"where {path!r}: {name!r} is not a column of {model._meta.label}")
    named = _field_names(found, parts)
    if len(parts) - named > 1:
        raise WhereError(
            f"where {path!r}: {'__'.join(parts[:named])!r} leads to no field {parts[named]!r}",
            unknown_field=True,
        )
    lookup = "__".join(parts[named:]) or "exact"
    if named == 1 and lookup in LOOKUPS:
        return found, found.attname, lookup
    if named > 1 and hops is not None:
        try:
            hop = resolve(model, "__".join(parts[:named]))
        except PathError as exc:
            raise WhereError(f"where {path!r}: {exc}", unknown_field=True) from None
        if lookup not in LOOKUPS:
            raise WhereError(
                f"where {path!r}: lookup {lookup!r} is not supported (a related path is "
                "forward relations and a column; supported lookups: "
                f"{', '.join(sorted(LOOKUPS))})"
            )
        hops[hop.path] = hop
        return hop.field, hop.path, lookup
    if named > 1:
        raise WhereError(
            f"where {path!r} follows a relation: it cannot be decided from a row's own "
            f"values (compare {found.attname!r} instead)"
        )
    raise WhereError(
        f"where {path!r}: lookup {lookup!r} is not supported "
        f"(supported: {', '.join(sorted(LOOKUPS))})"
    )


def _field_names(field: models.Field | models.ForeignObjectRel, parts: list[str]) -> int:
    """How many of ``parts`` name fields (``field`` the first), as Django reads a lookup: each
    next name a field of the model the previous one relates to, unless it is the last name
    and a lookup."""
    named = 1
    while named < len(parts):
        name = parts[named]
        related = field.related_model if field.is_relation else None
        last = named == len(parts) - 1
        if (last and name in LOOKUPS) or not isinstance(related, type):
            break
        try:
            field = related._meta.pk if name == "pk" else related._meta.get_field(name)
        except FieldDoesNotExist:
            break
        named += 1
    return named


def _exact_collation(field: models.Field) -> bool:
    """Whether MySQL compares ``field``'s text byte for byte, trailing spaces included."""
    collation = getattr(field, "db_collation", None) or ""
    return collation == "binary" or collation.endswith(("_nopad_bin", "_0900_bin"))


def _items(value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        raise WhereError(f"an 'in' lookup takes a list of values, not {value!r}") from None


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "exact": lambda a, b: a == b,
    "gt": lambda a, b: a > b,
    "gte": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "lte": lambda a, b: a <= b,
}
