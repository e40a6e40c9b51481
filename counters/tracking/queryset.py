"""``CountedQuerySet`` and ``CountedManager``: the bulk paths of a tracked model, counted.

``update()``, ``delete()`` and ``bulk_create()`` (and ``bulk_update()``,
which Django runs through ``update()``) lock the rows they change, read
their tracked fields before and after, and send
:data:`~counters.tracking.counting.rows_changed` with both, inside the
transaction; the counters app's receiver adds the difference per key. An
``update()`` also counts the rows it changes of a tracked multi-table parent
or child (see :mod:`counters.tracking.relatives`). Querysets of a model without
trackers, and everything inside :func:`counters.paused`, behave exactly like
Django's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from django.db import NotSupportedError, models, transaction

from counters.base.context import counted_rows, is_paused
from counters.base.utils import batched, model_field
from counters.tracking.counting import rows_changed
from counters.tracking.deletes import being_deleted
from counters.tracking.middle import counted_update
from counters.tracking.relatives import (
    count_relatives,
    lock_relatives,
    lock_roots,
    spans_tables,
    touched_relatives,
)
from counters.tracking.rows import CHUNK, instance_row, locked_rows, plain, read_rows, with_related
from counters.tracking.trackers import middle_touched, touches, tracked_fields, trackers_for
from counters.tracking.where import is_expression, python_value


class CountedQuerySet(models.QuerySet[Any, Any]):
    """A QuerySet whose writes keep the counters of its model exact. Subclass it freely."""

    def _write_db(self) -> str:
        """The database the queryset writes to: its ``using()``, else the router's
        ``db_for_write`` (a locking clone's ``db`` is the one Django writes with)."""
        return self.select_for_update().db

    def update(self, **kwargs: Any) -> int:
        if not is_paused() and middle_touched(self.model, kwargs):
            _refuse_combined(self, "update")
            if self.query.is_sliced:
                raise TypeError("Cannot update a query once a slice has been taken.")
            using = self._write_db()

            def update_rows(pks: list[Any]) -> int:
                rows = CountedQuerySet(self.model, using=using)
                return sum(
                    rows.filter(pk__in=chunk)._update_rows(kwargs) for chunk in batched(pks, CHUNK)
                )

            changed = counted_update(self, kwargs, update_rows)
            self._result_cache = None
            return changed
        return self._update_rows(kwargs)

    update.alters_data = True  # type: ignore[attr-defined]

    def _update_rows(self, kwargs: dict[str, Any]) -> int:
        """``update(**kwargs)`` counted for the model's own trackers and its relatives."""
        model = self.model
        if is_paused():
            return super().update(**kwargs)
        relatives = touched_relatives(model, kwargs)
        if not relatives and not touches(model, kwargs):
            return super().update(**kwargs)
        _refuse_combined(self, "update")
        if self.query.is_sliced:
            raise TypeError("Cannot update a query once a slice has been taken.")
        using = self._write_db()
        with transaction.atomic(using=using):
            if spans_tables(model):  # the root table's rows first, as every route does
                lock_roots(model, self.values("pk"), using)
            locked = locked_rows(self)
            if not locked:
                return 0
            pks = [pk for pk, _ in locked]
            before = lock_relatives(relatives, pks, using)  # multi-table rows sharing these
            target = plain(model, using)
            moved = _moved_pks(model, using, pks, kwargs)
            changed = 0
            for chunk in batched(pks, CHUNK):
                changed += target.filter(pk__in=chunk).update(**kwargs)
            if touches(model, kwargs):
                if moved is None:  # rows a running delete deletes: it counts them (deletes.py)
                    gone = being_deleted(model, using)
                    locked = [(pk, row) for pk, row in locked if pk not in gone]
                old = [row for _, row in locked]
                new: list[dict[str, Any]] | None
                if moved is not None:
                    new = _moved_rows(model, using, moved, len(old))
                else:
                    new = _updated(model, old, kwargs)
                if new is None:  # expressions: the database computed the new values
                    new = read_rows(model, [pk for pk, _ in locked], using)
                if old or new:
                    rows_changed.send(sender=model, old=old, new=new, using=using)
            count_relatives(before, pks, using)
        self._result_cache = None
        return changed

    def delete(self) -> tuple[int, dict[str, int]]:
        model = self.model
        if is_paused() or not trackers_for(model):
            return super().delete()
        _refuse_combined(self, "delete")
        if self.query.is_sliced:
            raise TypeError("Cannot use 'limit' or 'offset' with delete().")
        if self.query.distinct_fields:
            raise TypeError("Cannot call delete() after .distinct(*fields).")
        if self.query.has_select_fields:
            raise TypeError("Cannot call delete() after .values() or .values_list()")
        using = self._write_db()
        total = 0
        per_model: Counter[str] = Counter()
        with transaction.atomic(using=using):
            if spans_tables(model):  # the root table's rows first, as every route does
                lock_roots(model, self.values("pk"), using)
            locked = locked_rows(self)
            pks = [pk for pk, _ in locked]
            # their related paths read now, before the cascades delete or null anything
            old = with_related(model, [row for _, row in locked], using)
            target = plain(model, using)
            # Django deletes row by row underneath (signals, cascades): those
            # rows are counted here, the cascades by their own receivers.
            with counted_rows(model, pks):
                for chunk in batched(pks, CHUNK):
                    deleted, by_model = target.filter(pk__in=chunk).delete()
                    total += deleted
                    per_model.update(by_model)
            if locked:
                rows_changed.send(sender=model, old=old, new=[], using=using, resolved=True)
        self._result_cache = None
        return total, dict(per_model)

    delete.alters_data = True  # type: ignore[attr-defined]
    delete.queryset_only = True  # type: ignore[attr-defined]

    def bulk_create(
        self,
        objs: Iterable[Any],
        batch_size: int | None = None,
        ignore_conflicts: bool = False,
        update_conflicts: bool = False,
        update_fields: Collection[str] | None = None,
        unique_fields: Collection[str] | None = None,
    ) -> list[Any]:
        model = self.model
        options: dict[str, Any] = {
            "batch_size": batch_size,
            "ignore_conflicts": ignore_conflicts,
            "update_conflicts": update_conflicts,
            "update_fields": update_fields,
            "unique_fields": unique_fields,
        }
        if is_paused() or not trackers_for(model):
            return super().bulk_create(objs, **options)
        if ignore_conflicts or update_conflicts:
            raise NotSupportedError(
                f"{model.__name__}.objects.bulk_create() cannot count rows skipped or updated "
                "on conflict; insert without ignore_conflicts/update_conflicts, or inside "
                "counters.paused() followed by a rebuild."
            )
        objs = list(objs)
        using = self._write_db()
        with transaction.atomic(using=using, savepoint=False):
            created = super().bulk_create(objs, **options)
            new, unknown = [], []
            for obj in objs:
                row = instance_row(obj)
                if row is not None:
                    new.append(row)
                elif obj.pk is not None:
                    unknown.append(obj.pk)
                else:
                    raise NotSupportedError(
                        f"{model.__name__}.objects.bulk_create(): a value of a counted field is "
                        "an expression, and this database does not return the new rows' keys"
                    )
            if unknown:
                new += read_rows(model, unknown, using)
            if new:
                rows_changed.send(sender=model, old=[], new=new, using=using)
        return created


def _moved_pks(
    model: type[models.Model], using: str, pks: list[Any], kwargs: Mapping[str, Any]
) -> list[Any] | None:
    """The primary keys rows ``pks`` will have after ``update(**kwargs)``, or None if kept.

    An update that sets the primary key moves each row to a new key: its new
    state is read there. An expression (``F("id") + 1000``) is evaluated for
    each locked row before the update, by the same database; the rows are
    locked, so the UPDATE computes the same keys from the same values.
    """
    found = [(n, v) for n, v in kwargs.items() if model_field(model, n).primary_key]
    if not found:
        return None
    pk_field = model_field(model, "pk")
    value = found[0][1]
    if not is_expression(value):
        return [python_value(pk_field, value)] if pks else []
    alias = "_counters_moved_to"
    moved: list[Any] = []
    for chunk in batched(pks, CHUNK):
        rows = plain(model, using).filter(pk__in=chunk).annotate(**{alias: value})
        moved.extend(rows.values_list(alias, flat=True))
    return moved


def _moved_rows(
    model: type[models.Model], using: str, moved: list[Any], expected: int
) -> list[dict[str, Any]]:
    """The rows at their new primary keys ``moved``; all ``expected`` of them, or it raises.

    A key the database computes differently for the UPDATE than for the read
    before it (a random or time-dependent expression) would count a row as
    gone: that update is refused and rolled back, nothing changed.
    """
    pk_field = model_field(model, "pk")
    keys = sorted({python_value(pk_field, pk) for pk in moved})
    rows = read_rows(model, keys, using)
    if len(rows) != expected:
        raise NotSupportedError(
            f"{model._meta.label}.objects.update(): the new primary keys of {expected} "
            f"row(s) could not be computed before the update ({len(rows)} found after it); "
            "nothing was changed: move rows with a deterministic expression of their own "
            "columns"
        )
    return rows


def _updated(
    model: type[models.Model], old: list[dict[str, Any]], kwargs: Mapping[str, Any]
) -> list[dict[str, Any]] | None:
    """The rows after ``update(**kwargs)`` if computable from plain values, else None."""
    tracked = {f.attname for f in tracked_fields(model)}
    changes: dict[str, Any] = {}
    for name, value in kwargs.items():
        field = model_field(model, name)
        if field.attname not in tracked:
            continue
        if is_expression(value):
            return None
        try:
            changes[field.attname] = python_value(field, value)
        except Exception:
            return None
    return [{**row, **changes} for row in old]


class CountedManager(models.Manager.from_queryset(CountedQuerySet)):  # type: ignore[misc]
    """The default manager of a tracked model: its querysets are :class:`CountedQuerySet`."""


def _refuse_combined(qs: models.QuerySet[Any, Any], method: str) -> None:
    """Refuse ``method`` on a combined query (``union()`` and the like), as Django does."""
    combinator = qs.query.combinator
    if combinator:
        raise NotSupportedError(
            f"Calling QuerySet.{method}() after {combinator}() is not supported."
        )
