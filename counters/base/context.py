"""Switches of the counted paths that hold for the current thread or async task.

- :func:`paused` turns counting off, for a data migration or ``loaddata``.
- :func:`counted_rows` tells the instance receivers that a queryset path has
  counted these rows already, so a delete that Django runs per instance
  underneath is never counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.db import models

_paused: ContextVar[bool] = ContextVar("counters_paused", default=False)
_counted: ContextVar[dict[type[models.Model], frozenset[Any]] | None] = ContextVar(
    "counters_counted", default=None
)


@contextmanager
def paused() -> Iterator[None]:
    """Do not count the changes made inside the block (this thread or task only).

    For data migrations, ``loaddata`` (saves with ``raw=True`` are never
    counted anyway) and bulk fixes made on purpose without counting. The
    counters are wrong afterwards by what changed: run
    ``manage.py counters_rebuild`` once the block is done.
    """
    token = _paused.set(True)
    try:
        yield
    finally:
        _paused.reset(token)


def is_paused() -> bool:
    return _paused.get()


@contextmanager
def counted_rows(model: type[models.Model], pks: Iterable[Any]) -> Iterator[None]:
    """Rows ``pks`` of ``model`` are counted by the caller while the block runs."""
    concrete = model._meta.concrete_model or model
    current: dict[type[models.Model], frozenset[Any]] = _counted.get() or {}
    merged = {**current, concrete: current.get(concrete, frozenset()) | frozenset(pks)}
    token = _counted.set(merged)
    try:
        yield
    finally:
        _counted.reset(token)


def already_counted(model: type[models.Model], pk: Any) -> bool:
    rows = _counted.get()
    return rows is not None and pk in rows.get(model._meta.concrete_model or model, ())
