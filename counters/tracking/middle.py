"""Changes of a middle row of a related path: the rows below it move at once.

With ``key="post__author"`` (or ``where=Q(post__published=True)``) a comment's
contribution depends on its post. A change of the post's ``author`` (or
``published``) by ``save()`` or by ``QuerySet.update()`` (the collector's
``SET_NULL``, related managers and ``bulk_update()`` go through it) locks the
posts, reads their old values, writes, reads the new ones, and moves the
contributions of every comment below them in one aggregate query per
tracker: ``COUNT`` (or ``SUM``) grouped by post and by the comments' own
tracked columns, counted once with the old values and once with the new.
The deltas are added in the same transaction, as every counted path does.

A comment's own counted paths lock its post too before reading it
(:func:`~counters.tracking.rows.with_related`): either this change waits for
them and its aggregate sees their rows, or they wait for it and read the new
values. A deleted middle row needs no route of its own: the rows below it
are deleted (``CASCADE``) or updated (``SET_NULL``) through their own
counted paths while it still exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from django.db import connections, models, router, transaction

from counters.base.context import is_paused
from counters.base.utils import batched, concrete_model, target_field
from counters.tracking.paths import Hop
from counters.tracking.rows import CHUNK, Row, plain
from counters.tracking.trackers import Tracker, middle_hops, middle_touched
from counters.write.add import add_members

Pairs = tuple[tuple[Tracker, Hop], ...]


def _columns(pairs: Pairs) -> list[str]:
    """The attnames of the middle rows that ``pairs`` read, link targets included."""
    names: list[str] = []
    for _, hop in pairs:
        for attname in (target_field(hop.link).attname, hop.field.attname):
            if attname not in names:
                names.append(attname)
    return names


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


def counted_update(
    qs: models.QuerySet, kwargs: Mapping[str, Any], update: Callable[[list[Any]], int]
) -> int:
    """``qs.update(**kwargs)`` of middle rows, run by ``update(pks)``, and the rows below moved."""
    model = qs.model
    pairs = middle_touched(model, kwargs)
    using = qs.db
    columns = _columns(middle_hops(model))  # every hop: a tracker reads them all
    with transaction.atomic(using=using):
        old = _locked(qs, columns)
        if not old:
            return 0
        pks = list(old)
        changed = update(pks)
        move(pairs, old, _read(model, pks, columns, using), using)
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
    columns = _columns(middle_hops(model))  # every hop: a tracker reads them all
    with transaction.atomic(using=using):
        old = _locked(plain(model, using).filter(pk=obj.pk), columns)
        updated = write()
        if updated and old:
            move(pairs, old, _read(model, list(old), columns, using), using)
    return updated


def move(pairs: Pairs, old: dict[Any, Row], new: dict[Any, Row], using: str) -> None:
    """Add what the rows below the middle rows lost with ``old`` and gained with ``new``.

    A tracker's related paths all go through one relation (``track()``
    refuses two, ``counters.E056``): its middle rows are the only ones its
    rows read.
    """
    members: dict[str, int] = {}
    for tracker in dict.fromkeys(t for t, _ in pairs):
        _move_rows(tracker, old, new, members, using)
    add_members({m: d for m, d in members.items() if d}, using=using)


def _move_rows(
    tracker: Tracker, old: dict[Any, Row], new: dict[Any, Row], members: dict[str, int], using: str
) -> None:
    """The moves of ``tracker``'s rows below the changed middle rows, into ``members``."""
    link = tracker.related[0].link
    target = target_field(link).attname
    states: dict[Any, tuple[Row, Row]] = {}
    for pk, before in old.items():
        after = new.get(pk)
        if after is None or after[target] != before[target] or before[target] is None:
            continue  # gone or re-keyed: its rows below follow their own paths
        paths_before = {h.path: before[h.field.attname] for h in tracker.related}
        paths_after = {h.path: after[h.field.attname] for h in tracker.related}
        if paths_before != paths_after:
            states[before[target]] = (paths_before, paths_after)
    group = [a for a in tracker.attnames if a != link.attname]
    member = tracker.spec.member
    for chunk in batched(sorted(states), CHUNK):
        rows = (
            plain(tracker.model, using)
            .filter(**{f"{link.attname}__in": chunk})
            .order_by()
            .values(link.attname, *group)
            .annotate(_counters_n=models.Count("pk"))
        )
        for found in rows:
            n = found.pop("_counters_n")
            before, after = states[found[link.attname]]
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
