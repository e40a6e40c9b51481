"""Multi-table relatives: the tracked models whose rows a write on another model changes.

A multi-table parent and its children share rows, with one primary key: a
write on one model can change the rows of a tracked relative
(:func:`relatives`). ``CountedQuerySet.update()`` and ``save()`` (the
receivers here) lock the relative's rows too, before the change, and count
them as the relative's own (:func:`lock_relatives`, :func:`count_relatives`).
Deletes need nothing more: Django's collector sends
``pre_delete``/``post_delete`` for the parent rows and the children it deletes.

Invariant: every route to a row spanning several tables locks its root
row first (:func:`lock_roots`), so writers through the parent and through the
child queue on one row instead of deadlocking on two.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import connections, models, router

from counters.base.context import is_paused
from counters.base.utils import batched, concrete_model
from counters.tracking.counting import rows_changed
from counters.tracking.rows import CHUNK, locked_rows, plain, read_rows
from counters.tracking.trackers import touches, tracked_models

#: Instance attribute holding the relatives' rows read by :func:`before_save`.
_RELATIVES = "_counters_relatives"

Locked = dict[type[models.Model], list[tuple[Any, dict[str, Any]]]]


# -- who shares rows ---------------------------------------------------------------


def _tables(model: type[models.Model]) -> set[type[models.Model]]:
    """The concrete models whose tables hold part of a row of ``model``."""
    concrete = concrete_model(model)
    return {concrete, *concrete._meta.get_parent_list()}


def relatives(model: type[models.Model]) -> tuple[type[models.Model], ...]:
    """The tracked models, other than ``model``'s own, whose rows a write on ``model`` can change.

    Multi-table parents, children and siblings: they share a table, and a
    row of one has the same primary key in the other.
    """
    concrete = concrete_model(model)
    tables = _tables(concrete)
    return tuple(t for t in tracked_models() if t is not concrete and tables & _tables(t))


def touched_relatives(
    model: type[models.Model], names: Iterable[str]
) -> tuple[type[models.Model], ...]:
    """The :func:`relatives` whose tracked fields include one of ``names``."""
    names = list(names)
    return tuple(t for t in relatives(model) if touches(t, names))


def spans_tables(model: type[models.Model]) -> bool:
    """Whether a row of ``model`` spans several tables, or shares one with a tracked relative."""
    return bool(concrete_model(model)._meta.parents) or bool(relatives(model))


def _roots(model: type[models.Model]) -> list[type[models.Model]]:
    concrete = concrete_model(model)
    roots = [p for p in concrete._meta.get_parent_list() if not p._meta.parents] or [concrete]
    return sorted(roots, key=lambda m: m._meta.label)


def lock_roots(model: type[models.Model], pks: Any, using: str) -> None:
    """Lock the rows ``pks`` (a list or a queryset of primary keys) in the root table(s).

    Every route to a row spanning several tables takes this lock first, so
    writers through the parent and through the child queue on one row
    instead of deadlocking on two. Must run inside a transaction.
    """
    for root in _roots(model):
        list(plain(root, using).filter(pk__in=pks).select_for_update().values_list("pk"))


def sharers(model: type[models.Model]) -> list[type[models.Model]]:
    """``model``, its proxies, and every multi-table relative and its proxies."""
    tables = _tables(model)
    found = [m for m in model._meta.apps.get_models() if tables & _tables(m)]
    return found if model in found else [model, *found]


# -- counting the relatives' rows --------------------------------------------------


def lock_relatives(models_: Iterable[type[models.Model]], pks: list[Any], using: str) -> Locked:
    """``{model: [(pk, row)]}``: the rows ``pks`` of each model, locked (or read) now."""
    conn = connections[using]
    locked: Locked = {}
    for model in models_:
        rows: list[tuple[Any, dict[str, Any]]] = []
        for chunk in batched(pks, CHUNK):
            if conn.in_atomic_block:
                rows += locked_rows(plain(model, using).filter(pk__in=chunk))
            else:  # a save Django runs in autocommit (save_base of an untracked model)
                found = plain(model, using).filter(pk__in=chunk).order_by("pk")
                pk_list = list(found.values_list("pk", flat=True))
                rows += list(zip(pk_list, read_rows(model, pk_list, using), strict=True))
        locked[model] = rows
    return locked


def count_relatives(before: Locked, pks: list[Any], using: str) -> None:
    """Count ``after - before`` of the rows ``pks`` of each model of ``before``."""
    for model, locked in before.items():
        old = [row for _, row in locked]
        new = read_rows(model, pks, using)
        if old or new:
            rows_changed.send(sender=model, old=old, new=new, using=using)


# -- save -----------------------------------------------------------------------------


def before_save(
    sender: type[models.Model],
    instance: models.Model,
    raw: bool = False,
    using: str | None = None,
    update_fields: Iterable[str] | None = None,
    **kwargs: Any,
) -> None:
    """``pre_save``: lock and read the saved row in its tracked relatives' tables."""
    instance.__dict__.pop(_RELATIVES, None)
    if raw or is_paused():
        return
    found = relatives(sender) if update_fields is None else touched_relatives(sender, update_fields)
    if not found:
        return
    using = using or router.db_for_write(sender, instance=instance)
    pks = [] if instance.pk is None else [instance.pk]
    instance.__dict__[_RELATIVES] = (using, lock_relatives(found, pks, using))


def after_save(
    sender: type[models.Model],
    instance: models.Model,
    raw: bool = False,
    **kwargs: Any,
) -> None:
    """``post_save``: count the saved row's change in each tracked relative."""
    saving = instance.__dict__.pop(_RELATIVES, None)
    if saving is None or raw:
        return
    using, before = saving
    count_relatives(before, [instance.pk], using)
