"""The tracked values of rows, as every counted path compares them.

A row is ``{attname: value}`` of the tracked fields of its model
(:func:`~counters.tracking.trackers.tracked_fields`): locked and read inside the
transaction before a change (:func:`locked_rows`), read back after it
(:func:`read_rows`), or taken from the instance a save writes
(:func:`instance_row`). The inner reads and writes go through a plain
queryset (:func:`plain`), so they are never counted themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.db import connections, models

from counters.base.utils import batched
from counters.tracking.trackers import tracked_fields
from counters.tracking.where import is_expression, python_value

Row = dict[str, Any]

#: Largest IN list of primary keys in one statement.
CHUNK = 2000


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
    for chunk in batched(pks, CHUNK):
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
    row: Row = dict(base) if base else {}
    for field in tracked_fields(type(obj)):
        attname = field.attname
        if wanted is not None and field.name not in wanted and attname not in wanted:
            continue
        value = getattr(obj, attname)
        if is_expression(value):
            return None
        try:
            row[attname] = python_value(field, value)
        except Exception:
            return None
    return row


#: The clause that locks the selected rows in share mode, per database vendor.
SHARE_LOCK = {"postgresql": " FOR SHARE", "mysql": " LOCK IN SHARE MODE"}


def share_locked(qs: models.QuerySet) -> list[tuple[Any, ...]]:
    """The rows of ``qs`` (a ``values_list()``), locked in share mode until the transaction ends.

    A share lock conflicts with the ``FOR UPDATE`` a change of a middle row
    takes (:mod:`counters.tracking.middle`), and not with another share lock
    nor with a foreign key check: writers of rows below one middle row do not
    queue on each other. Django has no share mode, so the clause is added to
    its SQL. SQLite locks the database instead; elsewhere the rows are locked
    ``FOR UPDATE``.
    """
    connection = connections[qs.db]
    clause = SHARE_LOCK.get(connection.vendor)
    if clause is None:
        return list(qs.select_for_update() if connection.features.has_select_for_update else qs)
    compiler = qs.query.get_compiler(using=qs.db)
    sql, params = compiler.as_sql()
    with connection.cursor() as cursor:
        cursor.execute(sql + clause, params)
        rows: list[Any] = cursor.fetchall()
    fields = [s[0] for s in compiler.select[0 : compiler.col_count]]
    converters = compiler.get_converters(fields)
    if converters:
        rows = [tuple(row) for row in compiler.apply_converters(rows, converters)]
    return [tuple(row) for row in rows]
