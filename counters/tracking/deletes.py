"""What a delete counts, read once at its start, whatever order Django then works in.

Django's deletion collector first sends ``pre_delete`` for every row it will
delete, then runs its field updates (``SET_NULL``, ``SET_DEFAULT``, ``SET()``,
and, on MySQL/MariaDB, the ``SET NULL`` of a nullable ``CASCADE`` key before
the rows go), then deletes model by model, in an order it only fixes for
non-nullable keys: PostgreSQL may delete a post before its notes. A note's
related key (``post__author``) read when its own delete is counted could find
its post gone, and a row nulled then deleted could count twice.

So, for the duration of a collector's ``delete()`` (:func:`collecting`, installed
by :func:`counters.tracking.routes.install_collector`):

- the first ``pre_delete`` of a tracked model locks and reads all the rows of
  that model the collector will delete, in one statement per chunk, with the
  values of their related paths (:func:`deleted_row`); each row's removal is
  counted from that snapshot, taken before any statement of the delete ran;
- a field update of those same rows, and the move of the rows below a middle
  row, leave them out (:func:`being_deleted`): their removal counts them once,
  from what they were before the delete began.

Invariant: a row the collector deletes is counted once, as it was when the
delete began; a row it only updates is counted by its update, old and new
values read under lock when the update runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.db import models

from counters.base.utils import batched, concrete_model
from counters.tracking.rows import CHUNK, Row, locked_rows, plain, with_related


@dataclass
class _Delete:
    """One collector's delete: the rows it will delete, and those read so far."""

    using: str
    pks: dict[type[models.Model], set[Any]]
    read: dict[type[models.Model], dict[Any, Row | None]] = field(default_factory=dict)


_deleting: contextvars.ContextVar[tuple[_Delete, ...]] = contextvars.ContextVar(
    "counters_deleting", default=()
)

#: Returned by :func:`deleted_row` for a row no collector's delete is known to hold.
UNKNOWN: Any = object()


@contextlib.contextmanager
def collecting(using: str, data: Iterable[tuple[type[models.Model], Iterable[Any]]]) -> Iterator:
    """While the block runs, the rows ``data`` (``(model, instances)``) are being deleted."""
    pks: dict[type[models.Model], set[Any]] = {}
    for model, instances in data:
        pks.setdefault(concrete_model(model), set()).update(obj.pk for obj in instances)
    token = _deleting.set((*_deleting.get(), _Delete(using, pks)))
    try:
        yield
    finally:
        _deleting.reset(token)


def being_deleted(model: type[models.Model], using: str) -> set[Any]:
    """The primary keys of the rows of ``model`` that a running delete will delete."""
    concrete = concrete_model(model)
    found: set[Any] = set()
    for delete in _deleting.get():
        if delete.using == using:
            found |= delete.pks.get(concrete, set())
    return found


def deleted_row(model: type[models.Model], pk: Any, using: str) -> Row | None:
    """The row ``pk`` of ``model`` as it was when the running delete began, or UNKNOWN.

    Read with its related paths (locked), with every other row of ``model``
    that delete deletes, at the first of them. A row gone by then is None.
    """
    concrete = concrete_model(model)
    for delete in reversed(_deleting.get()):
        if delete.using != using or pk not in delete.pks.get(concrete, ()):
            continue
        read = delete.read.get(concrete)
        if read is None:
            read = delete.read[concrete] = _snapshot(model, sorted_pks(delete.pks[concrete]), using)
        return read.pop(pk, None)
    return UNKNOWN


def sorted_pks(pks: Iterable[Any]) -> list[Any]:
    """``pks`` in a stable order (the order rows are locked in), whatever their type."""
    try:
        return sorted(pks)
    except TypeError:
        return sorted(pks, key=repr)


def _snapshot(model: type[models.Model], pks: list[Any], using: str) -> dict[Any, Row | None]:
    """``{pk: row with its related paths}`` of the rows ``pks``, locked, in one read per chunk."""
    locked: list[tuple[Any, Row]] = []
    for chunk in batched(pks, CHUNK):
        locked += locked_rows(plain(model, using).filter(pk__in=chunk))
    rows = with_related(model, [row for _, row in locked], using)
    pairs = zip(locked, rows, strict=True)
    return {pk: None if row is None else dict(row) for (pk, _), row in pairs}
