"""Composite keys: a counter keyed by several columns of its rows, ``(user_id, day)``.

A key is a :class:`CompositeKey`, a tuple whose ``str()`` is its Redis form: a
JSON array of its parts, each as its field's Python value in text (an integer
stays a number, a date is ``"YYYY-MM-DD"``). One key has one text, and the
text gives the key back: :meth:`KeyCodec.normalize` turns a tuple, a list or
that text into the key, so ``(7, "2026-11-25")`` and ``(7, date(2026, 11, 25))``
are one counter, as ``"7"`` and ``7`` are for a plain key.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Sequence
from typing import Any

from django.db import models

from counters.base.utils import target_field


class CompositeKey(tuple):
    """A normalised composite key: a tuple, whose ``str()`` is its member text."""

    __slots__ = ()

    def __str__(self) -> str:
        return json.dumps([_plain(part) for part in self], separators=(",", ":"))


def _plain(value: Any) -> Any:
    """A part as JSON holds it: integers and strings as they are, dates and UUIDs as text."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        if isinstance(value, datetime.date | uuid.UUID):
            return str(value)
        raise TypeError(f"{type(value).__name__} is not a key part")
    return value


#: Field types a key part may be stored in (a relation: its target field's type).
PART_TYPES = (models.IntegerField, models.CharField, models.DateField, models.UUIDField)


def part_type_problem(field: models.Field) -> str | None:
    """Why the values of ``field`` cannot be a key part, or None."""
    target = target_field(field) if field.is_relation else field
    if isinstance(target, models.DateTimeField) or not isinstance(target, PART_TYPES):
        return (
            f"{field.name!r} holds {target.get_internal_type()} values; a key part is an "
            "integer, a string, a date or a UUID"
        )
    return None


class KeyCodec:
    """The parts of a composite key, as the fields of the counter rows that store them."""

    def __init__(self, fields: Sequence[models.Field]) -> None:
        self.fields = tuple(fields)
        self._converters = tuple(
            (target_field(f) if f.is_relation else f).to_python for f in self.fields
        )

    def normalize(self, key: Any) -> CompositeKey:
        """``key`` (a tuple, a list, or the text of a key) as a :class:`CompositeKey`.

        Raises ``ValueError`` (or the fields' ``ValidationError``) for anything else.
        """
        if isinstance(key, CompositeKey):
            return key
        if isinstance(key, str | bytes):
            key = json.loads(key)
        if not isinstance(key, tuple | list) or len(key) != len(self.fields):
            raise ValueError(f"a key of this counter is a tuple of {len(self.fields)} values")
        parts = []
        for convert, part in zip(self._converters, key, strict=True):
            if part is None or isinstance(part, models.Model):
                raise ValueError("a key part is a value: not None, nor a model instance")
            value = convert(part)
            if value is None:
                raise ValueError("None is not a key part")
            if isinstance(part, float) and value != part:
                raise ValueError(f"{part!r} is not exactly a value of its key field")
            parts.append(value)
        normal = CompositeKey(parts)
        str(normal)  # raises TypeError for a part JSON cannot hold
        return normal

    def db_values(self, key: CompositeKey, conn: Any) -> list[Any]:
        """The database values of ``key``'s parts on ``conn``."""
        return [f.get_db_prep_value(part, conn) for f, part in zip(self.fields, key, strict=True)]
