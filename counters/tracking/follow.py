"""The values of related paths, read along their relations with every row on the way locked.

A row of the source carries the value of each related path of its trackers
(``row["post__blog__owner"]``, :func:`with_related`); a changed middle row
the values of the paths below it (``"blog__owner"`` of a post,
:mod:`counters.tracking.middle`). Both come from :func:`path_values`: the
rows the paths reach are read depth by depth, outward (every post, then
every blog), each depth share-locked in key order before the next one is
read (:func:`~counters.tracking.rows.share_locked`).

Invariant: a row read here stays share-locked until the transaction ends.
A change of a middle row locks it ``FOR UPDATE`` first, so it either waits
for the readers of its values (and its aggregate then sees their rows) or
they wait for it and read its new values. Every change locks inward rows
before outward ones (a post before its blog), never the other way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import models

from counters.base.utils import batched, concrete_model, related_model, target_field
from counters.tracking.paths import Hop
from counters.tracking.rows import CHUNK, plain, share_locked
from counters.tracking.trackers import trackers_for

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
