"""The tracked values of rows, and of their related paths, as every counted path compares them.

A row is ``{attname: value}`` of the tracked fields of its model
(:func:`~counters.tracking.trackers.tracked_fields`): locked and read inside the
transaction before a change (:func:`locked_rows`), read back after it
(:func:`read_rows`), or taken from the instance a save writes
(:func:`instance_row`). The inner reads and writes go through a plain
queryset (:func:`plain`), so they are never counted themselves.

A row of the source carries the value of each related path of its trackers
(``row["post__blog__owner"]``, :func:`with_related`); a changed middle row
the values of the paths below it (``"blog__owner"`` of a post,
:mod:`counters.tracking.middle`). Both come from :func:`path_values`: the
rows the paths reach are read depth by depth, outward (every post, then
every blog), each depth share-locked in key order before the next one is
read (:func:`share_locked`).

Invariant: a row read along a related path stays share-locked until the
transaction ends. A change of a middle row locks it ``FOR UPDATE`` first,
so it either waits for the readers of its values (and its aggregate then
sees their rows) or they wait for it and read its new values. Every change
locks inward rows before outward ones (a post before its blog), never the
other way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import connections, models

from counters.base.utils import batched, concrete_model, related_model, target_field
from counters.tracking.paths import Hop
from counters.tracking.trackers import tracked_fields, trackers_for
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


# -- related paths -------------------------------------------------------------------------

#: The relations a path follows, by name from the model it starts from: a node of the walk.
Prefix = tuple[str, ...]
#: ``{key: {attname: value}}`` of the rows read at one node, by the key their relation points to.
Found = dict[Any, dict[str, Any]]


def with_related(
    model: type[models.Model], rows: Sequence[Mapping[str, Any] | None], using: str
) -> list[Mapping[str, Any] | None]:
    """``rows`` of ``model`` with the values of its trackers' related paths added.

    Rows of a model without related paths are returned as they are.
    """
    hops: dict[str, Hop] = {}
    for tracker in trackers_for(model):
        hops.update((hop.path, hop) for hop in tracker.related)
    if not hops:
        return list(rows)
    values = path_values(rows, list(hops.values()), using)
    return [
        None if row is None else {**row, **(found or {})}
        for row, found in zip(rows, values, strict=True)
    ]


def path_values(
    rows: Sequence[Mapping[str, Any] | None], hops: Iterable[Hop], using: str
) -> list[dict[str, Any] | None]:
    """``{hop.path: value}`` of each row (None for None), the rows on the way share-locked.

    A hop starts from the row's own column ``links[0].attname`` (a hop
    without links is the row's column ``field.attname``). A path broken on
    the way (a NULL relation, a row not found) has the value None.
    """
    hops = list(hops)
    nodes = _nodes(hops)
    found: dict[Prefix, Found] = {}
    for prefix in sorted(nodes, key=lambda p: (len(p), p)):  # outward, then in a fixed order
        link, columns = nodes[prefix]
        if len(prefix) == 1:
            sources: Iterable[Mapping[str, Any] | None] = rows
        else:
            sources = found[prefix[:-1]].values()
        ids = {row.get(link.attname) for row in sources if row is not None} - {None}
        found[prefix] = _read(link, ids, columns, using)
    return [None if row is None else {h.path: _walk(row, h, found) for h in hops} for row in rows]


def _nodes(hops: list[Hop]) -> dict[Prefix, tuple[models.Field, list[str]]]:
    """``{prefix: (its last relation, the columns read at the model it points to)}``."""
    nodes: dict[Prefix, tuple[models.Field, list[str]]] = {}
    for hop in hops:
        names = tuple(link.name for link in hop.links)
        for depth, link in enumerate(hop.links, 1):
            _, columns = nodes.setdefault(names[:depth], (link, []))
            # the column of the next relation on the way, or the one the path reads at its end
            last = depth == len(names)
            _add(columns, hop.field.attname if last else hop.links[depth].attname)
    return nodes


def _add(columns: list[str], attname: str) -> None:
    if attname not in columns:
        columns.append(attname)


def _read(link: models.Field, ids: set[Any], columns: list[str], using: str) -> Found:
    """The rows ``link`` points to with keys ``ids``, share-locked in primary key order
    (the order a change of them locks them in)."""
    if not ids:
        return {}
    model = concrete_model(related_model(link))
    key = target_field(link).attname
    found: Found = {}
    for chunk in batched(sorted(ids), CHUNK):
        qs = plain(model, using).filter(**{f"{key}__in": chunk}).order_by("pk")
        for value, *rest in share_locked(qs.values_list(key, *columns)):
            found[value] = dict(zip(columns, rest, strict=True))
    return found


def _walk(row: Mapping[str, Any], hop: Hop, found: dict[Prefix, Found]) -> Any:
    """The value of ``hop`` for ``row``, following the rows read at each node."""
    current: Mapping[str, Any] | None = row
    for depth, link in enumerate(hop.links, 1):
        key = current.get(link.attname) if current is not None else None
        if key is None:
            return None
        current = found[tuple(item.name for item in hop.links[:depth])].get(key)
    return None if current is None else current.get(hop.field.attname)
