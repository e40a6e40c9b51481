"""The one rule that turns a change of tracked rows into deltas, and the receivers applying it.

One rule for every path: inside a transaction, lock the rows the change
touches, read what they contributed (:func:`~counters.tracking.rows.locked_rows`),
change them, and add ``after - before`` per key (:func:`count`). Racing
callers queue on the row locks and the second one reads the first one's
result, so a change is counted once. On SQLite, which has no row locks,
write transactions must be serialised by the database
(``"transaction_mode": "IMMEDIATE"``) to the same effect.

Where each change is seen (:mod:`counters.tracking.routes` installs each one):

- a save, in the model's ``_save_table()`` (:func:`counted_write`), the call
  that writes the row: the row is locked and read right before the
  statement, the values written are read right after it, before any
  ``post_save`` receiver runs. A save with a primary key runs in
  ``atomic()`` so that the lock holds until the write commits.
- ``pre_delete`` locks and reads the row inside Django's delete transaction,
  ``post_delete`` counts its removal. Cascades from a parent arrive here too.
- :data:`rows_changed`, sent by :class:`~counters.CountedQuerySet` for
  ``update()``, ``delete()``, ``bulk_create()`` and ``bulk_update()``, and for
  the rows of multi-table relatives (:mod:`counters.tracking.relatives`).

Saves with ``raw=True`` (``loaddata``) and changes inside
:func:`counters.paused` are not counted.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from django.db import DatabaseError, NotSupportedError, connections, models, router, transaction
from django.dispatch import Signal

from counters.base.context import already_counted, is_paused
from counters.base.utils import concrete_model
from counters.tracking.deletes import UNKNOWN, deleted_row
from counters.tracking.rows import Row, instance_row, locked_rows, plain, read_rows, with_related
from counters.tracking.trackers import (
    InsertPlan,
    touches,
    tracked_attnames,
    trackers_for,
)
from counters.tracking.where import is_expression
from counters.write.add import add_made, add_members

logger = logging.getLogger(__name__)

#: Sent with ``sender`` (the model), ``old``, ``new`` and ``using`` after rows of a tracked
#: model changed, inside the transaction: ``old`` and ``new`` are lists of
#: ``{attname: value}`` of the tracked fields (a created row is only in ``new``, a deleted
#: one only in ``old``); ``using`` is the database alias; ``resolved`` (optional, False)
#: says ``old`` carries the values of its related paths already, read before a delete.
#: The rows were locked while they were read, so ``new - old`` is exactly what the change
#: did. Its receiver (:func:`count_rows`) adds that difference to every counter tracking
#: ``sender``; other receivers may watch it too (an audit log, a cache to drop).
rows_changed = Signal()

#: Instance attribute holding what ``pre_delete`` read, for ``post_delete``.
_DELETING = "_counters_deleting"


def count(
    model: type[models.Model],
    old: Iterable[Mapping[str, Any] | None],
    new: Iterable[Mapping[str, Any] | None],
    using: str,
    resolved: bool = False,
) -> None:
    """Add ``new - old`` of every counter tracking ``model``, once the transaction commits.

    The deltas of all its counters go together: one push for the change.
    ``resolved``: ``old`` carries the values of its related paths already (read
    before a delete began, :mod:`counters.tracking.deletes`).
    """
    old, new = list(old), list(new)
    trackers = trackers_for(model)
    if any(tracker.related for tracker in trackers):
        if resolved:
            new = with_related(model, new, using)
        else:
            both = with_related(model, old + new, using)  # one locking read: in key order
            old, new = both[: len(old)], both[len(old) :]
    members: dict[str, int] = {}
    for tracker in trackers:
        tracker.add_members(members, old, new)
    add_members(members, using=using)


# -- save ------------------------------------------------------------------------

#: How many times one save re-reads a row that appeared between its lock and its write.
SAVE_ATTEMPTS = 5

#: Instance attribute: the row of a multi-table child read before its parents' tables were
#: written (``{"model": ..., "row": ...}``), for the count of its own table's write.
_BEFORE_PARENTS = "_counters_before_parents"


def read_before_parents(
    obj: models.Model, model: type[models.Model], using: str, update_fields: Any
) -> None:
    """Lock and keep the row of ``obj`` (a multi-table child) before its parents' tables change.

    A tracked field may live in a parent's table: it is written before the
    child's own ``_save_table()``, so the old state must be read first. Django
    runs a multi-table save in ``atomic()``: the lock holds until it commits.
    """
    obj.__dict__.pop(_BEFORE_PARENTS, None)
    if (
        obj.pk is not None
        and not is_paused()
        and concrete_model(type(obj)) is model
        and trackers_for(model)
        and (update_fields is None or touches(model, update_fields))
        and connections[using].in_atomic_block
    ):
        found = locked_rows(plain(model, using).filter(pk=obj.pk))
        if found:
            obj.__dict__[_BEFORE_PARENTS] = {"model": model, "row": found[0][1]}


def needs_transaction(obj: models.Model, update_fields: Iterable[str] | None) -> bool:
    """Whether a save of ``obj`` must run in ``atomic()``: it may update a counted row.

    An insert does not: :func:`counted_write` opens a transaction of its own
    around one that must read its row back or lock related rows (a save of a
    multi-table child runs in Django's own).
    """
    if update_fields is not None and not touches(type(obj), update_fields):
        return False
    return obj.pk is not None  # the row may exist: its old state is read under a lock


def _has_related(model: type[models.Model]) -> bool:
    """Whether a tracker of ``model`` reads related rows: locked until the write commits."""
    return any(tracker.related for tracker in trackers_for(model))


def _has_expression(obj: models.Model) -> bool:
    """Whether a tracked value of ``obj`` is an expression (a deferred field is none)."""
    values = obj.__dict__
    return any(is_expression(values.get(attname)) for attname in tracked_attnames(type(obj)))


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
    plan: InsertPlan | None,
) -> bool:
    """Run ``write`` (Django's ``_save_table()`` of ``obj``'s row) and count what it did.

    Returns what ``write`` returns (True if it updated a row, False if it
    inserted one). A row that may be updated is locked and read inside a
    transaction (one is opened if none is), so no racing writer can change it
    between the read and the write. ``plan``: :func:`insert_plan` of ``model``.
    """
    pk = obj.pk
    if pk is not None and is_expression(pk):
        raise NotSupportedError(
            f"{model._meta.label}.save(): the primary key is an expression "
            f"({pk!r}); a counted row cannot be moved by a save: use "
            "QuerySet.update() with the new key, or a plain value"
        )
    before = obj.__dict__.pop(_BEFORE_PARENTS, None)
    may_update = pk is not None and _may_update(obj, model, force_insert)
    if not may_update:
        values = obj.__dict__
        if plan is not None and not plan.has_expression(values):
            # Nothing to lock or read: its values are plain (no expression), and no tracker
            # reads related rows. Counted by ``plan`` from the values Django wrote.
            updated = write()  # False: Django inserted the row
            members = plan.members(values)
            if members is None:  # a value to convert, or one the database decided
                count(model, [], [_new_row(obj, model, using, None, None)], using)
            else:
                add_made(members, using)
            return updated
    if before is not None and before["model"] is model and may_update:
        # a multi-table child whose parents' tables are written already: count from the
        # row read before them (still locked, in the save's transaction)
        updated = write()
        new = _new_row(obj, model, using, update_fields, before["row"] if updated else None)
        count(model, [before["row"] if updated else None], [new], using)
        return updated
    if (may_update or _has_expression(obj) or _has_related(model)) and not connections[
        using
    ].in_atomic_block:
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
    """``pre_delete`` (inside Django's delete transaction): the row as the delete found it.

    Read with the values of its related paths before any statement of the
    delete runs (:func:`~counters.tracking.deletes.deleted_row`), so the order
    in which Django then deletes or nulls its relatives changes nothing.
    """
    instance.__dict__.pop(_DELETING, None)
    if is_paused() or not trackers_for(sender) or instance.pk is None:
        return
    if already_counted(sender, instance.pk):
        return  # a counted queryset delete counts it
    using = using or router.db_for_write(sender, instance=instance)
    row: Any = deleted_row(sender, instance.pk, using)
    if row is UNKNOWN:  # not through a collector's delete(): read it now
        found = locked_rows(plain(sender, using).filter(pk=instance.pk))
        row = with_related(sender, [found[0][1] if found else None], using)[0]
    instance.__dict__[_DELETING] = (using, row)


def after_delete(
    sender: type[models.Model], instance: models.Model, using: str | None = None, **kwargs: Any
) -> None:
    """``post_delete``: count the removal of what the row contributed."""
    deleting = instance.__dict__.pop(_DELETING, None)
    if deleting is None:
        return
    using, old = deleting
    count(sender, [old], [], using, resolved=True)


# -- rows_changed ------------------------------------------------------------------


def count_rows(
    sender: type[models.Model],
    old: Iterable[Mapping[str, Any]],
    new: Iterable[Mapping[str, Any]],
    using: str,
    resolved: bool = False,
    **kwargs: Any,
) -> None:
    """The receiver of :data:`rows_changed`: count ``new - old``."""
    count(sender, old, new, using, resolved)
