"""The routes by which Django changes rows of a tracked model besides its own managers.

Capture is complete, or the declaration is refused. :func:`install` (called
by ``track()``) covers, for the tracked model and every model sharing its
rows (:func:`sharers`: its proxies, its multi-table parents and children and
their proxies):

- The base manager (``Model._base_manager``). Django's related managers
  (``add()``, ``set()``) and the deletion collector's ``SET_NULL``,
  ``SET_DEFAULT`` and ``SET(value)`` updates go through it. Django builds a
  plain one unless ``Meta.base_manager_name`` names one: the models get a
  counted one instead (a :class:`~counters.CountedQuerySet` of every row). A
  named base manager must be counted itself, or ``track()`` refuses
  (``counters.E045``).
- The collector's updates by primary key. ``SET(callable)`` loads the rows
  and Django updates them with a raw ``UpdateQuery``: :func:`install_collector`
  turns such rows back into a queryset of the (counted) base manager.
- Multi-table inheritance. A parent and its children share rows, with one
  primary key. A write on one model can change the rows of a tracked
  relative (:func:`relatives`): ``CountedQuerySet.update()`` and ``save()``
  (the receivers here) lock the relative's rows too, before the change, and
  count them as the relative's own. Deletes need nothing more: Django's
  collector sends ``pre_delete``/``post_delete`` for the parent rows and the
  children it deletes.
- The default manager of every sharer must be counted, or ``track()``
  refuses (``counters.E046``); ``check`` warns about their other managers
  (``counters.W002``).

Invariant: every row that a write can change and that some tracker reads is
locked and read before the write, and read after it, in the same
transaction; each tracked model's change is counted once, by one receiver.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

from django.db import connections, models, router, transaction
from django.db.models.deletion import Collector
from django.db.models.options import Options
from django.utils.functional import cached_property

from .context import is_paused
from .counting import locked_rows, plain, read_rows
from .signals import rows_changed
from .tracking import touches, tracked_models
from .utils import batched, concrete_model

logger = logging.getLogger(__name__)

#: Largest IN list of primary keys in one statement.
CHUNK = 2000
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


def _install_root_lock(model: type[models.Model], method: str) -> None:
    """Run ``model.<method>()`` of an existing row in ``atomic()``, its root row locked first.

    For ``save`` and ``delete`` of a row spanning several tables (see
    :func:`lock_roots`); idempotent.
    """
    flag = f"_counters_root_lock_{method}"
    if model.__dict__.get(flag):
        return
    original = getattr(model, method)

    @functools.wraps(original)
    def locked(self: models.Model, *args: Any, **kwargs: Any) -> Any:
        if is_paused() or self.pk is None or not spans_tables(type(self)):
            return original(self, *args, **kwargs)
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        if connections[using].in_atomic_block:
            lock_roots(type(self), [self.pk], using)
            return original(self, *args, **kwargs)
        with transaction.atomic(using=using):
            lock_roots(type(self), [self.pk], using)
            return original(self, *args, **kwargs)

    locked.alters_data = True  # type: ignore[attr-defined]
    setattr(model, method, locked)
    setattr(model, flag, True)


# -- the base manager -----------------------------------------------------------------


class CountedOptions(Options):
    """``Options`` whose automatic base manager counts (a ``CountedQuerySet`` of every row)."""

    @cached_property
    def base_manager(self) -> models.Manager:
        from .queryset import CountedManager, CountedQuerySet

        manager = Options.base_manager.func(self)  # type: ignore[attr-defined]
        if not manager.auto_created or isinstance(manager.get_queryset(), CountedQuerySet):
            return manager
        counted = CountedManager()
        counted.name = manager.name
        counted.model = self.model
        counted.auto_created = True
        return counted


def _install_base_manager(model: type[models.Model]) -> None:
    meta = model._meta
    if not isinstance(meta, CountedOptions):
        meta.__class__ = CountedOptions
        meta.__dict__.pop("base_manager", None)


# -- the collector ---------------------------------------------------------------------


def _rows_to_update(collector: Collector, field: models.Field, objs: Any) -> Any:
    """``objs`` as a queryset of the base manager if updating ``field`` may change a counter.

    Django updates a queryset not yet evaluated with ``update()`` (counted),
    and loaded rows by primary key with a raw ``UpdateQuery`` (not counted).
    """
    if is_paused() or (isinstance(objs, models.QuerySet) and objs._result_cache is None):
        return objs
    objs = list(objs)
    if not objs:
        return objs
    model = type(objs[0])
    if not (touches(model, [field.name]) or touched_relatives(model, [field.name])):
        return objs
    pks = [obj.pk for obj in objs]
    return model._base_manager.using(collector.using).filter(pk__in=pks)


def install_collector() -> None:
    """Route the deletion collector's field updates of counted rows through ``update()``."""
    if getattr(Collector.add_field_update, "_counters", False):
        return
    original = Collector.add_field_update

    @functools.wraps(original)
    def add_field_update(self: Collector, field: models.Field, value: Any, objs: Any) -> None:
        original(self, field, value, _rows_to_update(self, field, objs))

    add_field_update._counters = True  # type: ignore[attr-defined]
    Collector.add_field_update = add_field_update  # type: ignore[method-assign]


# -- install and refuse ----------------------------------------------------------------


def install(model: type[models.Model]) -> None:
    """Count every route to the rows of tracked ``model`` (see the module doc); idempotent."""
    from django.db.models.signals import post_save, pre_save

    install_collector()
    for sharer in sharers(model):
        _install_base_manager(sharer)
        if spans_tables(sharer):
            _install_root_lock(sharer, "save")
            _install_root_lock(sharer, "delete")
        if not relatives(sharer):
            continue  # no receiver on the saves of a model that shares no tracked rows
        uid = f"counters:relatives:{sharer._meta.label}"
        pre_save.connect(before_save, sender=sharer, dispatch_uid=f"{uid}:pre_save")
        post_save.connect(after_save, sender=sharer, dispatch_uid=f"{uid}:post_save")


def refusal(model: type[models.Model]) -> tuple[str, str] | None:
    """``(check id, problem)`` if a model sharing ``model``'s rows has an uncounted route."""
    from .queryset import CountedQuerySet

    for sharer in sharers(model):
        label = sharer._meta.label
        base = sharer._meta.base_manager
        if not base.auto_created and not isinstance(base.get_queryset(), CountedQuerySet):
            return (
                "counters.E045",
                f"the base manager {label}.{base.name} (Meta.base_manager_name) makes "
                f"{type(base.get_queryset()).__name__} querysets: Django's related managers "
                "and SET_NULL/SET()/SET_DEFAULT update rows through it uncounted; give it a "
                "counters.CountedQuerySet",
            )
        if sharer is model:
            continue  # its default manager is E013
        default = sharer._default_manager
        if not isinstance(default.get_queryset(), CountedQuerySet):
            kind = "proxy" if sharer._meta.proxy else "multi-table relative"
            return (
                "counters.E046",
                f"{label}, a {kind} of {model._meta.label}, has the default manager "
                f"{label}.{default.name} making {type(default.get_queryset()).__name__} "
                "querysets, whose update() and bulk_create() change its rows uncounted: "
                "use counters.CountedManager()",
            )
    return None


def other_managers(model: type[models.Model]) -> list[tuple[type[models.Model], str]]:
    """``(sharer, manager name)`` of each uncounted non-default manager of a sharer."""
    from .queryset import CountedQuerySet

    found = []
    for sharer in sharers(model):
        if sharer is model:
            continue  # its own managers: see counters.checks.check_trackers
        for manager in sharer._meta.managers:
            if manager.name == sharer._default_manager.name:
                continue
            if not isinstance(manager.get_queryset(), CountedQuerySet):
                found.append((sharer, manager.name))
    return found


def refused_models() -> list[tuple[type[models.Model], str, str]]:
    """``(model, check id, problem)`` of the tracked models :func:`refusal` refuses now."""
    found = []
    for model in tracked_models():
        problem = refusal(model)
        if problem is not None:
            found.append((model, *problem))
    return found
