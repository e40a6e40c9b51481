"""The routes by which Django changes rows of a tracked model, each one made to count.

Capture is complete, or the declaration is refused (:mod:`counters.tracking.refusals`).
:func:`install_tracked` (called by ``track()``) is the one place where Tally
hooks into Django, and every method it wraps goes through one function
(:func:`_wrap`, once per class and wrapper). On the tracked model:

- ``_save_table()``, the one call of ``save_base()`` that writes the model's
  row, counts what its statement did
  (:func:`~counters.tracking.counting.counted_write`): the row locked and read
  right before, the values written right after. No receiver runs in
  between, so a receiver that saves the instance again (its own write,
  counted on its own), changes it or raises, in whatever order it was
  connected, never changes what a save counts. A multi-table child's row is
  read before ``_save_parents()`` writes its parents' tables.
- ``save()`` runs in ``atomic()`` when it may update a row, as one unit with
  its receivers. Inserts of plain values need no lock and keep their cost:
  Django commits them before ``post_save``, and they are counted before it too.
- ``pre_delete``/``post_delete`` receivers (:func:`connect_model`), per model,
  so Django keeps fast-deleting the rows of every model that is not tracked.
- Counters keyed by a natural key keep tombstones (:mod:`counters.tracking.tombs`).
- Each middle model of a related key or where (``"post__author"``; the post
  and the blog of ``"post__blog__owner"``): its ``_save_table()``, and its
  base manager and ``update()``, move the rows below a changed row
  (:mod:`counters.tracking.middle`).

And for every model sharing its rows
(:func:`~counters.tracking.relatives.sharers`: its proxies, its multi-table
parents and children and their proxies):

- The base manager (``Model._base_manager``). Django's related managers
  (``add()``, ``set()``) and the deletion collector's ``SET_NULL``,
  ``SET_DEFAULT`` and ``SET(value)`` updates go through it. Django builds a
  plain one unless ``Meta.base_manager_name`` names one: the models get a
  counted one instead (a :class:`~counters.CountedQuerySet` of every row). A
  named base manager must be counted itself, or ``track()`` refuses
  (``counters.E045``).
- The collector's ``delete()``: the rows it deletes are read, with their
  related paths, before any of its statements (:mod:`counters.tracking.deletes`).
- The collector's updates by primary key. ``SET(callable)`` loads the rows
  and Django updates them with a raw ``UpdateQuery``: :func:`install_collector`
  turns such rows back into a queryset of the (counted) base manager.
- Multi-table inheritance (:mod:`counters.tracking.relatives`): ``save()`` and
  ``delete()`` of a row spanning several tables lock its root row first, and
  the saves of a model sharing tracked rows count them as the relative's own.
- The default manager of every sharer must be counted, or ``track()``
  refuses (``counters.E046``); ``check`` warns about their other managers
  (``counters.W002``).

Invariant: every row that a write can change and that some tracker reads is
locked and read before the write, and read after it, in the same
transaction; each tracked model's change is counted once, by one receiver.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from django.apps import apps
from django.db import connections, models, router, transaction
from django.db.models.deletion import Collector
from django.db.models.options import Options
from django.db.models.signals import post_delete, post_save, pre_delete, pre_save
from django.utils.functional import cached_property

from counters.base.context import is_paused
from counters.base.utils import concrete_model
from counters.tracking import tombs
from counters.tracking.counting import (
    after_delete,
    before_delete,
    counted_write,
    needs_transaction,
    read_before_parents,
)
from counters.tracking.deletes import collecting
from counters.tracking.middle import middle_save_table
from counters.tracking.queryset import CountedManager, CountedQuerySet
from counters.tracking.relatives import (
    after_save,
    before_save,
    lock_roots,
    relatives,
    sharers,
    spans_tables,
    touched_relatives,
)
from counters.tracking.trackers import (
    Tracker,
    insert_plan,
    middle_touched,
    touches,
    tracked_models,
    trackers_for,
)

Method = Callable[..., Any]
#: Class attribute: the ``(method, wrapper)`` pairs :func:`_wrap` installed on that class.
_WRAPPED = "_counters_wrapped"


def install_tracked(tracker: Tracker) -> None:
    """Count every route to the rows of ``tracker``'s model (see the module doc); idempotent."""
    model = tracker.model
    _wrap(model, "save", _atomic_save)
    _wrap(model, "_save_table", _counted_save_table)
    if model._meta.parents:
        _wrap(model, "_save_parents", _read_before_parents)
    connect_model(model)
    spec = tracker.spec
    if tombs.reusable(spec) and spec.target_model is not None:
        tombs.connect(spec.target_model)
    for tracked in tracked_models():  # a new tracked model may be a relative of the others
        _install_sharers(tracked)
    middles = tracker.chain.middles() if tracker.related else []
    for middle in middles:  # the middle rows of its related paths, every depth (middle.py)
        _wrap(middle, "_save_table", middle_save_table)
        _install_base_manager(middle)


def _install_sharers(model: type[models.Model]) -> None:
    """The routes through the models sharing the rows of tracked ``model``; idempotent."""
    install_collector()
    for sharer in sharers(model):
        _install_base_manager(sharer)
        if spans_tables(sharer):
            _wrap(sharer, "save", _root_locked)
            _wrap(sharer, "delete", _root_locked)
        if not relatives(sharer):
            continue  # no receiver on the saves of a model that shares no tracked rows
        uid = f"counters:relatives:{sharer._meta.label}"
        pre_save.connect(before_save, sender=sharer, dispatch_uid=f"{uid}:pre_save")
        post_save.connect(after_save, sender=sharer, dispatch_uid=f"{uid}:post_save")


def connect_model(model: type[models.Model]) -> None:
    """Connect the delete receivers of a tracked model (and its proxies); idempotent.

    The receivers are connected per model, so Django keeps fast-deleting the
    rows of every model that is not tracked. Saves are counted without
    receivers (:func:`_counted_save_table`).
    """
    senders = [model] + [
        m for m in apps.get_models() if m._meta.proxy and m._meta.concrete_model is model
    ]
    for sender in senders:
        uid = f"counters:{sender._meta.label}"
        pre_delete.connect(before_delete, sender=sender, dispatch_uid=f"{uid}:pre_delete")
        post_delete.connect(after_delete, sender=sender, dispatch_uid=f"{uid}:post_delete")


# -- the model's methods ------------------------------------------------------------


def _wrap(
    model: type[models.Model], method: str, make: Callable[[Method, type[models.Model]], Method]
) -> None:
    """Replace ``model.<method>`` by ``make(original, model)``, once per class and wrapper."""
    wrapped: set[tuple[str, str]] | None = model.__dict__.get(_WRAPPED)
    if wrapped is None:
        wrapped = set()
        setattr(model, _WRAPPED, wrapped)
    if (method, make.__name__) in wrapped:
        return
    setattr(model, method, make(getattr(model, method), model))
    wrapped.add((method, make.__name__))


def _atomic_save(original: Method, model: type[models.Model]) -> Method:
    """``save()`` in ``atomic()`` when it may update a counted row (its lock holds to COMMIT)."""

    @functools.wraps(original)
    def save(self: models.Model, *args: Any, **kwargs: Any) -> None:
        if is_paused() or not needs_transaction(self, kwargs.get("update_fields")):
            return original(self, *args, **kwargs)
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using):
            return original(self, *args, **kwargs)

    save.alters_data = True  # type: ignore[attr-defined]
    return save


def _counted_save_table(original: Method, model: type[models.Model]) -> Method:
    """``_save_table()`` counting the write of a row of ``model``'s own table."""

    @functools.wraps(original)
    def _save_table(
        self: models.Model,
        raw: bool = False,
        cls: type[models.Model] | None = None,
        force_insert: Any = False,
        force_update: bool = False,
        using: str | None = None,
        update_fields: Iterable[str] | None = None,
    ) -> bool:
        def write_row() -> bool:
            return original(self, raw, cls, force_insert, force_update, using, update_fields)

        if (
            cls is not model
            or raw
            or is_paused()
            or (type(self) is not model and concrete_model(type(self)) is not model)
        ):
            return write_row()  # another table (a parent's, a child's), or not counted
        plan = insert_plan(cls)  # None: no trackers, or one of them reads related rows
        if (plan is None and not trackers_for(cls)) or (
            update_fields is not None and not touches(cls, update_fields)
        ):
            return write_row()
        using = using or router.db_for_write(cls, instance=self)
        return counted_write(self, cls, write_row, using, update_fields, bool(force_insert), plan)

    return _save_table


def _read_before_parents(original: Method, model: type[models.Model]) -> Method:
    """``_save_parents()`` of a multi-table child, its own row read before the parents'."""

    @functools.wraps(original)
    def _save_parents(
        self: models.Model, cls: Any, using: str, update_fields: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if cls is model:  # Django recurses for the grandparents: keep what was read
            read_before_parents(self, model, using, update_fields)
        return original(self, cls, using, update_fields, *args, **kwargs)

    return _save_parents


def _root_locked(original: Method, model: type[models.Model]) -> Method:
    """``save()`` or ``delete()`` of an existing row in ``atomic()``, its root row locked first.

    For a row spanning several tables (see
    :func:`~counters.tracking.relatives.lock_roots`).
    """

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
    return locked


# -- the base manager -----------------------------------------------------------------


class CountedOptions(Options):
    """``Options`` whose automatic base manager counts (a ``CountedQuerySet`` of every row)."""

    @cached_property
    def base_manager(self) -> models.Manager:
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
    """``objs`` as a queryset not yet evaluated if updating ``field`` may change a counter.

    Django updates a queryset not yet evaluated with ``update()`` (counted),
    and loaded rows by primary key with a raw ``UpdateQuery`` (not counted): a
    queryset goes on as a fresh clone of itself, loaded rows as a queryset of
    the base manager.
    """
    if is_paused():
        return objs
    if isinstance(objs, models.QuerySet):
        return objs.all()
    objs = list(objs)
    if not objs:
        return objs
    model = type(objs[0])
    names = [field.name]
    if not (
        touches(model, names) or touched_relatives(model, names) or middle_touched(model, names)
    ):
        return objs
    pks = [obj.pk for obj in objs]
    return model._base_manager.using(collector.using).filter(pk__in=pks)


def install_collector() -> None:
    """Route the deletion collector's field updates of counted rows through ``update()``,
    and read what its deletes count before any of its statements runs (``deletes.py``)."""
    if getattr(Collector.add_field_update, "_counters", False):
        return
    original = Collector.add_field_update
    original_delete = Collector.delete

    @functools.wraps(original)
    def add_field_update(self: Collector, field: models.Field, value: Any, objs: Any) -> None:
        original(self, field, value, _rows_to_update(self, field, objs))

    @functools.wraps(original_delete)
    def delete(self: Collector) -> Any:
        if is_paused():
            return original_delete(self)
        with collecting(self.using, self.data.items()):
            return original_delete(self)

    add_field_update._counters = True  # type: ignore[attr-defined]
    Collector.add_field_update = add_field_update  # type: ignore[method-assign]
    Collector.delete = delete  # type: ignore[method-assign]
