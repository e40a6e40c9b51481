"""The receivers that count the changes of tracked rows, and the rows they compare.

One rule for every path: inside a transaction, lock the rows the change
touches, read what they contributed (:func:`locked_rows`), change them, and
add ``after - before`` per key (:func:`count`). Racing callers queue on the
row locks and the second one reads the first one's result, so a change is
counted once. On SQLite, which has no row locks, write transactions must be
serialised by the database (``"transaction_mode": "IMMEDIATE"``) to the same
effect.

Where each change is seen:

- a save, in the model's ``_save_table()`` (:func:`install_save`), the call
  that writes the row: the row is locked and read right before the
  statement, the values written are read right after it, before any
  ``post_save`` receiver runs. A save with a primary key runs in
  ``atomic()`` so that the lock holds until the write commits.
- ``pre_delete`` locks and reads the row inside Django's delete transaction,
  ``post_delete`` counts its removal. Cascades from a parent arrive here too.
- :data:`counters.signals.rows_changed`, sent by :class:`~counters.CountedQuerySet`
  for ``update()``, ``delete()``, ``bulk_create()`` and ``bulk_update()``.

Saves with ``raw=True`` (``loaddata``) and changes inside
:func:`counters.paused` are not counted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from django.db import DatabaseError, NotSupportedError, connections, models, router, transaction

from .context import already_counted, is_paused
from .tracking import touches, tracked_fields, trackers_for
from .utils import batched, concrete_model, target_field
from .where import is_expression, python_value
from .writes import add_many

logger = logging.getLogger(__name__)

Row = dict[str, Any]

#: Instance attribute holding what ``pre_delete`` read, for ``post_delete``.
_DELETING = "_counters_deleting"


def count(
    model: type[models.Model],
    old: Iterable[Mapping[str, Any] | None],
    new: Iterable[Mapping[str, Any] | None],
    using: str,
) -> None:
    """Add ``new - old`` of every counter tracking ``model``, once the transaction commits."""
    old, new = list(old), list(new)
    for tracker in trackers_for(model):
        deltas = tracker.deltas(old, new)
        if deltas:
            add_many(tracker.name, deltas, using=using)


def plain(model: type[models.Model], using: str) -> models.QuerySet:
    """An uncounted queryset of every row of ``model`` (for the inner reads and writes)."""
    return models.QuerySet(model, using=using)


def locked_rows(qs: models.QuerySet) -> list[tuple[Any, Row]]:
    """``(pk, row)`` of each row of ``qs``, locked until the transaction ends, in pk order.

    A row holds the tracked fields' values (``{attname: value}``). Only the
    model's own rows are locked (``OF self``), so querysets with joins work.
    Each pk appears once: a filter through a multi-valued relation returns a
    row once per related row, and a row changed once must count once.
    Must run inside a transaction.
    """
    model = qs.model
    using = qs.db
    attnames = [f.attname for f in tracked_fields(model)]
    query = qs
    if query.query.distinct or query.query.combinator or query.query.group_by is not None:
        # PostgreSQL locks no row of a DISTINCT or GROUP BY: lock the same rows by pk.
        query = plain(model, using).filter(pk__in=qs.values("pk"))
    features = connections[using].features
    if features.has_select_for_update_of:
        query = query.select_for_update(of=("self",))
    else:
        query = query.select_for_update()
    rows = query.prefetch_related(None).order_by("pk").values_list("pk", *attnames)
    unique: dict[Any, Row] = {}
    for values in rows:
        if values[0] not in unique:
            unique[values[0]] = dict(zip(attnames, values[1:], strict=True))
    return list(unique.items())


def read_rows(model: type[models.Model], pks: list[Any], using: str) -> list[Row]:
    """The current rows ``pks`` (already locked by this transaction), in pk order."""
    attnames = [f.attname for f in tracked_fields(model)]
    rows: list[Row] = []
    for chunk in batched(pks, 2000):
        values = plain(model, using).filter(pk__in=chunk).order_by("pk").values_list(*attnames)
        rows.extend(dict(zip(attnames, v, strict=True)) for v in values)
    return rows


def instance_row(
    obj: models.Model, only: Iterable[str] | None = None, base: Mapping[str, Any] | None = None
) -> Row | None:
    """The row ``obj`` is saved as: its tracked values as the fields store them.

    ``only`` (field names or attnames) limits it to those fields, the others
    coming from ``base``. None if a value is an expression (the database
    decides it: read the row back) or not a value of its field.
    """
    wanted = None if only is None else set(only)
    row: Row = dict(base or {})
    for field in tracked_fields(type(obj)):
        if wanted is not None and field.name not in wanted and field.attname not in wanted:
            continue
        value = getattr(obj, field.attname)
        if is_expression(value):
            return None
        try:
            row[field.attname] = python_value(field, value)
        except Exception:
            return None
    return row


# -- save ------------------------------------------------------------------------

#: How many times one save re-reads a row that appeared between its lock and its write.
SAVE_ATTEMPTS = 5


def install_save(model: type[models.Model]) -> None:
    """Count every write of a row of ``model`` where Django makes it; idempotent.

    Two wrappers on the model class:

    - ``_save_table()``, the one call of ``save_base()`` that writes the
      model's row, counts what its statement did (:func:`counted_write`):
      the row locked and read right before, the values written right after.
      No receiver runs in between, so a receiver that saves the instance
      again (its own write, counted on its own), changes it or raises, in
      whatever order it was connected, never changes what a save counts.
    - ``save()`` runs in ``atomic()`` when it may update a row, as one unit
      with its receivers. Inserts of plain values need no lock and keep
      their cost: Django commits them before ``post_save``, and they are
      counted before it too.
    """
    if model.__dict__.get("_counters_counted_save"):
        return
    original = model.save
    original_table = model._save_table  # type: ignore[attr-defined]

    @functools.wraps(original)
    def save(self: models.Model, *args: Any, **kwargs: Any) -> None:
        if is_paused() or not _needs_transaction(self, kwargs.get("update_fields")):
            return original(self, *args, **kwargs)
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using):
            return original(self, *args, **kwargs)

    @functools.wraps(original_table)
    def _save_table(
        self: models.Model,
        raw: bool = False,
        cls: type[models.Model] | None = None,
        force_insert: Any = False,
        force_update: bool = False,
        using: str | None = None,
        update_fields: Iterable[str] | None = None,
    ) -> bool:
        def write() -> bool:
            return original_table(self, raw, cls, force_insert, force_update, using, update_fields)

        if cls is not model or raw or is_paused() or concrete_model(type(self)) is not model:
            return write()  # another table (a parent's, a child's), or not counted
        if not trackers_for(cls) or (update_fields is not None and not touches(cls, update_fields)):
            return write()
        using = using or router.db_for_write(cls, instance=self)
        return counted_write(self, cls, write, using, update_fields, bool(force_insert))

    save.alters_data = True  # type: ignore[attr-defined]
    model.save = save  # type: ignore[method-assign]
    model._save_table = _save_table  # type: ignore[attr-defined]
    if model._meta.parents:
        _install_save_parents(model)
    model._counters_counted_save = True  # type: ignore[attr-defined]


#: Instance attribute: the row of a multi-table child read before its parents' tables were
#: written (``{"model": ..., "row": ...}``), for the count of its own table's write.
_BEFORE_PARENTS = "_counters_before_parents"


def _install_save_parents(model: type[models.Model]) -> None:
    """Read a multi-table child's row before ``_save_parents()`` writes its parents' tables.

    A tracked field may live in a parent's table: it is written before the
    child's own ``_save_table()``, so the old state must be read first. Django
    runs a multi-table save in ``atomic()``: the lock holds until it commits.
    """
    original_parents = model._save_parents  # type: ignore[attr-defined]

    @functools.wraps(original_parents)
    def _save_parents(
        self: models.Model, cls: Any, using: str, update_fields: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if cls is not model:  # Django recurses for the grandparents: keep what was read
            return original_parents(self, cls, using, update_fields, *args, **kwargs)
        self.__dict__.pop(_BEFORE_PARENTS, None)
        if (
            self.pk is not None
            and not is_paused()
            and concrete_model(type(self)) is model
            and trackers_for(model)
            and (update_fields is None or touches(model, update_fields))
            and connections[using].in_atomic_block
        ):
            found = locked_rows(plain(model, using).filter(pk=self.pk))
            if found:
                self.__dict__[_BEFORE_PARENTS] = {"model": model, "row": found[0][1]}
        return original_parents(self, cls, using, update_fields, *args, **kwargs)

    model._save_parents = _save_parents  # type: ignore[attr-defined]


def _needs_transaction(obj: models.Model, update_fields: Iterable[str] | None) -> bool:
    if update_fields is not None and not touches(type(obj), update_fields):
        return False
    if obj.pk is not None:
        return True  # the row may exist: its old state is read under a lock
    return _has_expression(obj)


def _has_expression(obj: models.Model) -> bool:
    return any(is_expression(getattr(obj, f.attname)) for f in tracked_fields(type(obj)))


def _may_update(obj: models.Model, model: type[models.Model], force_insert: bool) -> bool:
    """Whether Django's ``_save_table()`` tries an UPDATE first (else it only inserts)."""
    if force_insert or obj.pk is None:
        return False
    meta = model._meta
    # Django skips the UPDATE when adding an instance whose primary key has a default.
    return not (
        obj._state.adding and all(f.has_default() or f.has_db_default() for f in meta.pk_fields)
    )


def counted_write(
    obj: models.Model,
    model: type[models.Model],
    write: Callable[[], bool],
    using: str,
    update_fields: Iterable[str] | None,
    force_insert: bool,
) -> bool:
    """Run ``write`` (Django's ``_save_table()`` of ``obj``'s row) and count what it did.

    Returns what ``write`` returns (True if it updated a row, False if it
    inserted one). A row that may be updated is locked and read inside a
    transaction (one is opened if none is), so no racing writer can change it
    between the read and the write.
    """
    if is_expression(obj.pk):
        raise NotSupportedError(
            f"{model._meta.label}.save(): the primary key is an expression "
            f"({obj.pk!r}); a counted row cannot be moved by a save: use "
            "QuerySet.update() with the new key, or a plain value"
        )
    before = obj.__dict__.pop(_BEFORE_PARENTS, None)
    may_update = _may_update(obj, model, force_insert)
    if before is not None and before["model"] is model and may_update:
        # a multi-table child whose parents' tables are written already: count from the
        # row read before them (still locked, in the save's transaction)
        updated = write()
        new = _new_row(obj, model, using, update_fields, before["row"] if updated else None)
        count(model, [before["row"] if updated else None], [new], using)
        return updated
    conn = connections[using]
    if (may_update or _has_expression(obj)) and not conn.in_atomic_block:
        with transaction.atomic(using=using):
            return _write_and_count(obj, model, write, using, update_fields, may_update)
    return _write_and_count(obj, model, write, using, update_fields, may_update)


def _write_and_count(
    obj: models.Model,
    model: type[models.Model],
    write: Callable[[], bool],
    using: str,
    update_fields: Iterable[str] | None,
    may_update: bool,
) -> bool:
    """Write once, count ``new - old`` where ``old`` is what the statement replaced.

    An UPDATE replaced the row locked right before it. An INSERT replaced
    nothing. A row that no lock found but that the UPDATE changed (another
    transaction inserted it in between: Django's UPDATE-then-INSERT of a
    save with a primary key) has an old state nobody read: that write is
    rolled back to a savepoint, and the now visible row is locked and written
    again. So no interleaving counts a row twice.
    """
    old: Row | None = None
    updated = False
    for _ in range(SAVE_ATTEMPTS if may_update else 1):
        if not may_update:
            updated = write()
            break
        found = locked_rows(plain(model, using).filter(pk=obj.pk))
        old = found[0][1] if found else None
        if old is not None:
            updated = write()
            break
        updated = _write_in_savepoint(write, using)
        if not updated:
            break
        old = None  # rolled back: try again, the row now exists
    else:
        raise DatabaseError(
            f"{model._meta.label} {obj.pk!r}: the row kept appearing between its lock "
            "and its write; nothing was saved"
        )
    if not updated:
        old = None
    count(model, [old], [_new_row(obj, model, using, update_fields, old)], using)
    return updated


def _new_row(
    obj: models.Model,
    model: type[models.Model],
    using: str,
    update_fields: Iterable[str] | None,
    old: Row | None,
) -> Row | None:
    """The row ``obj``'s save wrote: its values, or read back if an expression decided them."""
    if update_fields is not None and old is not None:
        new = instance_row(obj, update_fields, base=old)
    else:
        new = instance_row(obj)
    if new is None:  # an expression, or an odd value: read back what was stored
        stored = read_rows(model, [obj.pk], using)
        new = stored[0] if stored else None
    return new


def _write_in_savepoint(write: Callable[[], bool], using: str) -> bool:
    """``write()`` kept if it inserted (False), rolled back if it updated a row (True)."""
    sid = transaction.savepoint(using=using)
    try:
        updated = write()
    except BaseException:
        with contextlib.suppress(DatabaseError):
            transaction.savepoint_rollback(sid, using=using)
        raise
    if updated:
        transaction.savepoint_rollback(sid, using=using)
    else:
        transaction.savepoint_commit(sid, using=using)
    return updated


# -- delete ------------------------------------------------------------------------


def before_delete(
    sender: type[models.Model],
    instance: models.Model,
    using: str | None = None,
    origin: Any = None,
    **kwargs: Any,
) -> None:
    """``pre_delete`` (inside Django's delete transaction): lock the row and keep it."""
    instance.__dict__.pop(_DELETING, None)
    if is_paused() or not trackers_for(sender) or instance.pk is None:
        return
    if already_counted(sender, instance.pk):
        return  # a counted queryset delete counts it
    using = using or router.db_for_write(sender, instance=instance)
    row = _cascaded_row(sender, instance, using, origin)
    if row is _UNKNOWN:
        found = locked_rows(plain(sender, using).filter(pk=instance.pk))
        row = found[0][1] if found else None
    instance.__dict__[_DELETING] = (using, row)


_UNKNOWN = object()
#: Connection attribute: (Django's delete transaction, {(model, key attname, key): {pk: row}}).
_CASCADE = "_counters_cascade"


def _cascaded_row(model: type[models.Model], instance: models.Model, using: str, origin: Any):
    """The locked row of ``instance`` if its parent ``origin`` is being deleted, else _UNKNOWN.

    A cascade from a parent deletes all its rows: they are locked and read in
    one statement at the first of them, not one by one. The rows read are
    kept for the rest of this delete transaction only (Django opens one per
    delete). A row the statement did not find under that parent (moved away
    meanwhile: Django deletes it by primary key all the same) is read alone.
    """
    if not isinstance(origin, models.Model) or origin is instance:
        return _UNKNOWN
    conn = connections[using]
    if not conn.atomic_blocks:
        return _UNKNOWN
    for tracker in trackers_for(model):
        parent = tracker.parent_model
        if parent is None or not isinstance(origin, parent):
            continue
        attname = tracker.key_field.attname
        value = getattr(origin, target_field(tracker.key_field).attname)
        if value is None or instance.__dict__.get(attname) != value:
            continue
        block = conn.atomic_blocks[-1]
        cache: tuple[Any, dict[tuple[Any, ...], dict[Any, Any]]] | None
        cache = conn.__dict__.get(_CASCADE)
        if cache is None or cache[0] is not block:
            cache = conn.__dict__[_CASCADE] = (block, {})
        concrete = concrete_model(model)
        parents: dict[tuple[Any, ...], dict[Any, Any]] = cache[1]
        rows = parents.get((concrete, attname, value))
        if rows is None:
            children = plain(concrete, using).filter(**{attname: value})
            rows = parents[(concrete, attname, value)] = dict(locked_rows(children))
        return rows.pop(instance.pk, _UNKNOWN)
    return _UNKNOWN


def after_delete(
    sender: type[models.Model], instance: models.Model, using: str | None = None, **kwargs: Any
) -> None:
    """``post_delete``: count the removal of what the row contributed."""
    deleting = instance.__dict__.pop(_DELETING, None)
    if deleting is None:
        return
    using, old = deleting
    count(sender, [old], [], using)


# -- CountedQuerySet's signal -----------------------------------------------------


def rows_changed(
    sender: type[models.Model],
    old: Iterable[Mapping[str, Any]],
    new: Iterable[Mapping[str, Any]],
    using: str,
    **kwargs: Any,
) -> None:
    """:data:`counters.signals.rows_changed`: count ``new - old``."""
    count(sender, old, new, using)
