"""Changes of a middle row of a related path: the rows below it move at once.

With ``key="post__author"`` (or ``where=Q(post__published=True)``) a comment's
contribution depends on its post; with ``key="post__blog__owner"`` on its
post and on that post's blog. A change of a middle row at any depth (the
post's ``author``, ``published`` or ``blog``; the blog's ``owner``) by
``save()`` or by ``QuerySet.update()`` (the collector's ``SET_NULL``,
related managers and ``bulk_update()`` go through it) locks the changed
rows ``FOR UPDATE``, reads their old values and those of the paths below
them (the rows on the way share-locked, :func:`~counters.tracking.rows.path_values`),
writes, reads the new ones (a new blog of a post share-locked before it is
read), and moves the contributions of every comment below them in one
aggregate query per tracker: ``COUNT`` (or ``SUM``) of the comments joined
up to the changed rows, grouped by the changed row's key, the comments' own
tracked columns and the values of the paths nearer than it, counted once
with the old values and once with the new. The deltas are added in the same
transaction, as every counted path does.

A comment's own counted paths share-lock every row along its paths before
reading them (:func:`~counters.tracking.rows.with_related`), and so does
a change of a middle row for the rows further out: a change at any depth
either waits for them and its aggregate sees their rows, or they wait for
it and read its new values. A deleted middle row needs no route of its own:
the rows below it are deleted (``CASCADE``) or updated (``SET_NULL``)
through their own counted paths; a deleted row below counts from what its
paths read before the delete began (:mod:`counters.tracking.deletes`), and a
move of a middle row during that delete leaves it out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from django.core.exceptions import FieldDoesNotExist
from django.db import connections, models, router, transaction

from counters.base.context import is_paused
from counters.base.utils import batched, concrete_model, model_field
from counters.tracking.deletes import being_deleted, sorted_pks
from counters.tracking.paths import Hop
from counters.tracking.rows import CHUNK, Row, path_values, plain
from counters.tracking.trackers import Through, Tracker, middle_hops, middle_touched
from counters.tracking.where import is_expression, python_value
from counters.write.add import add_members

#: ``{pk: (row, {path from the row: value})}`` of changed middle rows, before or after.
States = dict[Any, tuple[Row, dict[str, Any]]]


def _columns(through: Iterable[Through]) -> list[str]:
    """The attnames of the middle rows that ``through`` read, their keys included."""
    names: list[str] = []
    for tracker, depth in through:
        chain = tracker.chain
        for attname in (chain.key_column(depth), *(f.attname for f in chain.reads(depth))):
            if attname not in names:
                names.append(attname)
    return names


def _tails(pairs: Iterable[Through]) -> list[Hop]:
    """The paths ``pairs`` read from the middle rows, each from its own depth."""
    tails: dict[str, Hop] = {}
    for tracker, depth in pairs:
        for hop in tracker.chain.below(depth):
            tail = hop.tail(depth)
            tails.setdefault(tail.path, tail)
    return list(tails.values())


def _locked(qs: models.QuerySet, columns: list[str]) -> dict[Any, Row]:
    """``{pk: row}`` of the rows of ``qs``, locked until the transaction ends, in pk order."""
    if qs.query.distinct or qs.query.combinator or qs.query.group_by is not None:
        # PostgreSQL locks no row of a DISTINCT or GROUP BY: lock the same rows by pk.
        qs = plain(qs.model, qs.db).filter(pk__in=qs.values("pk"))
    query = qs.select_for_update(of=("self",)) if _has_of(qs.db) else qs.select_for_update()
    rows = query.prefetch_related(None).order_by("pk").values_list("pk", *columns)
    return {pk: dict(zip(columns, rest, strict=True)) for pk, *rest in rows}


def _has_of(using: str) -> bool:
    return bool(connections[using].features.has_select_for_update_of)


def _read(model: type[models.Model], pks: list[Any], columns: list[str], using: str) -> dict:
    found: dict[Any, Row] = {}
    for chunk in batched(pks, CHUNK):
        rows = plain(model, using).filter(pk__in=chunk).values_list("pk", *columns)
        found.update({pk: dict(zip(columns, rest, strict=True)) for pk, *rest in rows})
    return found


def _states(
    rows: dict[Any, Row], tails: list[Hop], using: str, planned: Row | None = None
) -> States:
    """``rows`` with the values of ``tails`` from each (the rows on the way share-locked).

    With ``planned`` (the values a write is about to set), the rows further
    out that the written rows will point to are share-locked in the same
    reads: the old and new rows of each depth at once, in key order, as every
    path locks them. (Locked one after the other, two writes moving posts
    between two blogs in opposite directions could each hold one blog and
    queue for the other behind a waiting change of it: a deadlock on MySQL
    and MariaDB, where a share lock queues behind a waiting exclusive one.)
    """
    if not tails:
        return {pk: (row, {}) for pk, row in rows.items()}
    listed = list(rows.values())
    extra = [{**row, **planned} for row in listed] if planned else []
    values = path_values(listed + extra, tails, using)
    return {pk: (row, values[i] or {}) for i, (pk, row) in enumerate(rows.items())}


def _planned(model: type[models.Model], columns: list[str], values: Mapping[str, Any]) -> Row:
    """``{attname: value}`` of ``columns`` that a write of ``values`` (names or attnames to
    values) sets, where a plain value says it ahead (an expression: the database decides)."""
    planned: Row = {}
    for name, value in values.items():
        try:
            field = model_field(model, name)
        except (FieldDoesNotExist, TypeError):
            continue
        if field.attname in columns and not is_expression(value):
            try:
                planned[field.attname] = python_value(field, value)
            except Exception:
                continue
    return planned


def _saved(obj: models.Model, columns: list[str], update_fields: Iterable[str] | None) -> Row:
    """``{attname: value}`` of ``columns`` a save of ``obj`` writes (deferred ones left out)."""
    wanted = None if update_fields is None else set(update_fields)
    values = obj.__dict__
    return {
        attname: values[attname]
        for attname in columns
        if attname in values
        and (wanted is None or attname in wanted or model_field(type(obj), attname).name in wanted)
    }


def counted_update(
    qs: models.QuerySet, kwargs: Mapping[str, Any], update: Callable[[list[Any]], int]
) -> int:
    """``qs.update(**kwargs)`` of middle rows, run by ``update(pks)``, and the rows below moved."""
    model = qs.model
    pairs = middle_touched(model, kwargs)
    using = qs.db
    columns = _columns(middle_hops(model))  # every tracker's: one read serves them all
    tails = _tails(pairs)
    with transaction.atomic(using=using):
        found = _locked(qs, columns)
        if not found:
            return 0
        old = _states(found, tails, using, _planned(model, columns, kwargs))
        pks = list(found)
        changed = update(pks)
        move(pairs, old, _states(_read(model, pks, columns, using), tails, using), using)
    return changed


def counted_save(
    obj: models.Model,
    model: type[models.Model],
    write: Callable[[], bool],
    using: str,
    update_fields: Iterable[str] | None,
) -> bool:
    """Django's ``_save_table()`` of a middle row (``write``), the rows below it moved."""
    pairs = middle_hops(model) if update_fields is None else middle_touched(model, update_fields)
    if obj.pk is None or not pairs:
        return write()  # a new row has nothing below it yet
    columns = _columns(middle_hops(model))  # every tracker's: one read serves them all
    tails = _tails(pairs)
    with transaction.atomic(using=using):
        found = _locked(plain(model, using).filter(pk=obj.pk), columns)
        planned = _planned(model, columns, _saved(obj, columns, update_fields))
        old = _states(found, tails, using, planned)
        updated = write()
        if updated and found:
            move(
                pairs, old, _states(_read(model, list(found), columns, using), tails, using), using
            )
    return updated


def move(pairs: Iterable[Through], old: States, new: States, using: str) -> None:
    """Add what the rows below the middle rows lost with ``old`` and gained with ``new``.

    A tracker's related paths all follow one chain of relations (``track()``
    refuses paths that part ways, ``counters.E056``): the middle rows at its
    depth are the only ones of this model its rows read.
    """
    members: dict[str, int] = {}
    for tracker, depth in dict.fromkeys(pairs):
        _move_rows(tracker, depth, old, new, members, using)
    add_members({m: d for m, d in members.items() if d}, using=using)


def _changes(tracker: Tracker, depth: int, old: States, new: States) -> dict[Any, tuple[Row, Row]]:
    """``{key of a middle row: (paths before, paths after)}`` of the rows whose paths changed."""
    chain = tracker.chain
    key = chain.key_column(depth)
    below = chain.below(depth)
    changes: dict[Any, tuple[Row, Row]] = {}
    for pk, (row, values) in old.items():
        after = new.get(pk)
        if after is None or after[0][key] != row[key] or row[key] is None:
            continue  # gone or re-keyed: its rows below follow their own paths
        before_paths = {h.path: values.get(h.tail(depth).path) for h in below}
        after_paths = {h.path: after[1].get(h.tail(depth).path) for h in below}
        if before_paths != after_paths:
            changes[row[key]] = (before_paths, after_paths)
    return changes


def _move_rows(
    tracker: Tracker,
    depth: int,
    old: States,
    new: States,
    members: dict[str, int],
    using: str,
) -> None:
    """The moves of ``tracker``'s rows below the changed middle rows, into ``members``."""
    changes = _changes(tracker, depth, old, new)
    chain = tracker.chain
    lookup = chain.lookup(depth)
    group = [a for a in tracker.attnames if a != lookup]
    group += [hop.path for hop in chain.above(depth)]
    member = tracker.spec.member
    gone = being_deleted(tracker.model, using)  # a running delete counts these (deletes.py)
    for chunk in batched(sorted(changes), CHUNK):
        below = plain(tracker.model, using).filter(**{f"{lookup}__in": chunk})
        if gone:
            below = below.exclude(pk__in=sorted_pks(gone))
        rows = below.order_by().values(lookup, *group).annotate(_counters_n=models.Count("pk"))
        for found in rows:
            n = found.pop("_counters_n")
            before, after = changes[found[lookup]]
            for paths, sign in ((before, -1), (after, 1)):
                counted = tracker.contribution({**found, **paths})
                if counted is not None and counted[1]:
                    name = member(counted[0])
                    members[name] = members.get(name, 0) + sign * n * counted[1]


def middle_save_table(original: Callable[..., bool], model: type[models.Model]) -> Callable:
    """``_save_table()`` of a middle model, counting what its write moves."""

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

        if cls is not model or raw or is_paused() or concrete_model(type(self)) is not model:
            return write_row()
        using = using or router.db_for_write(cls, instance=self)
        return counted_save(self, cls, write_row, using, update_fields)

    _save_table.__name__ = original.__name__
    _save_table.__doc__ = original.__doc__
    return _save_table
