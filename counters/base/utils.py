from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any, TypeVar, cast, overload

from django.db import models

K = TypeVar("K")
T = TypeVar("T")
V = TypeVar("V")

#: Most deltas a log line shows.
LOG_DELTAS = 20


def batched(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    """Lists of at most ``size`` items (``itertools.batched`` before Python 3.12)."""
    if size < 1:
        raise ValueError("size must be at least 1")
    it = iter(iterable)
    while chunk := list(islice(it, size)):
        yield chunk


def capped(items: Mapping[K, V], limit: int = LOG_DELTAS) -> dict[K, V]:
    """At most ``limit`` of ``items``, for a log line (a batch can hold thousands)."""
    return dict(islice(items.items(), limit))


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (its type's name if empty), at most ``limit`` long."""
    lines = str(exc).strip().splitlines()
    line = lines[0] if lines else type(exc).__name__
    return line if limit is None else line[:limit]


@overload
def to_str(value: bytes | str) -> str: ...
@overload
def to_str(value: None) -> None: ...
def to_str(value: bytes | str | None) -> str | None:
    """``value`` as a str: Redis replies are bytes unless the client decodes them."""
    return value.decode() if isinstance(value, bytes) else value


def target_field(field: models.Field[Any, Any]) -> models.Field[Any, Any]:
    """The field a relation ``field`` points to (``ForeignKey.target_field``)."""
    return cast("models.Field[Any, Any]", cast(Any, field).target_field)


def model_field(model: type[models.Model], name: str) -> models.Field[Any, Any]:
    """``model``'s concrete field ``name`` (``"pk"``: its primary key), typed as a Field."""
    meta = model._meta
    found = meta.pk if name == "pk" else meta.get_field(name)
    if not isinstance(found, models.Field):
        raise TypeError(f"{meta.label}.{name} is a reverse relation, not a field")
    return found


def concrete_model(model: type[models.Model]) -> type[models.Model]:
    """The concrete model whose table holds ``model``'s rows (itself unless a proxy)."""
    return model._meta.concrete_model or model


def related_model(field: models.Field[Any, Any]) -> type[models.Model]:
    """The model a relation ``field`` points to."""
    related = field.related_model
    if not isinstance(related, type):
        raise TypeError(f"{field} is not a resolved relation")
    return related


def column(field: models.Field[Any, Any]) -> str:
    """The database column of a concrete ``field``."""
    if field.column is None:
        raise TypeError(f"{field} has no column")
    return field.column


def stamped(field: models.Field[Any, Any]) -> bool:
    """Whether ``save()`` fills ``field`` with the current time (``auto_now``/``auto_now_add``)."""
    return bool(getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False))


def on_duplicate_key(conn: Any) -> tuple[str, Callable[[str], str]]:
    """MySQL's ``ON DUPLICATE KEY UPDATE``, written as Django writes it for this server.

    Returns the text to put between ``VALUES (…)`` and ``ON DUPLICATE KEY UPDATE``
    and a function naming the value a quoted column would have been inserted
    with: ``VALUE(c)`` on MariaDB, the row alias ``new`` on MySQL 8.0.19+
    (where ``VALUES(c)`` is deprecated), ``VALUES(c)`` before.
    """
    if conn.mysql_is_mariadb:
        return "", lambda c: f"VALUE({c})"
    if conn.mysql_version >= (8, 0, 19):
        return " AS new", lambda c: f"new.{c}"
    return "", lambda c: f"VALUES({c})"
