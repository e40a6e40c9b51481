"""Related keys and conditions: a path of forward relations, then a column of the model reached.

``key="post__author"`` counts a comment for the author of its post;
``key="post__blog__owner"`` for the owner of its post's blog;
``where=Q(post__published=True)`` counts it while its post is published.
Each such path is a :class:`Hop`: the forward foreign keys or one-to-ones it
follows (``links``: the first a column of the source's own rows, each next
one a column of the model the previous one points to) and the column read
at the end (``field``). A row of the source carries the value of a hop
under its ``path`` (``row["post__blog__owner"]`` is the owner's key), read
with every row along the path locked
(:func:`~counters.tracking.rows.with_related`); a change of a row in the
middle moves the contributions of every row below it at once
(:mod:`counters.tracking.middle`).

The related paths of one tracker follow one :class:`Chain` of relations:
each path's links are the first links of the longest one
(``post__blog__owner`` and ``post__published``). Paths that part ways
(:func:`parting`) are refused by ``track()`` (``counters.E056``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from django.core.exceptions import FieldDoesNotExist
from django.db import models

from counters.base.utils import concrete_model, related_model, target_field


class PathError(ValueError):
    """A path that cannot be counted: not forward relations followed by a column."""


@dataclass(frozen=True)
class Hop:
    """``links[0]__…__links[-1]__field``: ``links[0]`` on the model the path starts from.

    Invariant: ``links`` holds forward foreign keys or one-to-ones, each a
    column of the model the previous one points to; ``field`` is a column of
    the model the last one points to. A hop without links (:meth:`tail`) is
    a column of the model it starts from.
    """

    path: str
    links: tuple[models.Field, ...]
    field: models.Field

    @property
    def link(self) -> models.Field:
        """The first relation: a column of the source's own rows."""
        return self.links[0]

    @property
    def depth(self) -> int:
        """How many relations the path follows: the depth of the model ``field`` is read from."""
        return len(self.links)

    def tail(self, depth: int) -> Hop:
        """This path from the model at ``depth`` (0: the source), its first ``depth`` links cut."""
        links = self.links[depth:]
        return Hop("__".join([*(link.name for link in links), self.field.name]), links, self.field)


def _column(model: type[models.Model], name: str, path: str) -> models.Field:
    try:
        field = model._meta.pk if name == "pk" else model._meta.get_field(name)
    except FieldDoesNotExist:
        raise PathError(f"{path!r}: {model._meta.label} has no field {name!r}") from None
    if not isinstance(field, models.Field) or not field.concrete or field.many_to_many:
        raise PathError(f"{path!r}: {name!r} is not a column of {model._meta.label}")
    return field


def resolve(model: type[models.Model], path: str) -> Hop:
    """The hop of ``path`` (``"post__author"``, ``"post__blog__owner"``) from ``model``.

    Raises :class:`PathError` unless every name but the last is a forward
    foreign key or one-to-one, and the last a column of the model reached.
    """
    parts = path.split("__") if isinstance(path, str) else []
    if len(parts) < 2 or not all(parts):
        raise PathError(
            f"{path!r}: a related path is one or more forward foreign keys or one-to-ones, "
            'then a column of the model they reach ("post__author", "post__blog__owner")'
        )
    links: list[models.Field] = []
    current = model
    for name in parts[:-1]:
        link = _column(current, name, path)
        if not (link.many_to_one or link.one_to_one) or not isinstance(link.related_model, type):
            raise PathError(
                f"{path!r}: {name!r} is not a forward foreign key or one-to-one of "
                f"{current._meta.label}"
            )
        links.append(link)
        current = link.related_model
    field = _column(current, parts[-1], path)
    names = [link.name for link in links]
    return Hop(path="__".join([*names, field.name]), links=tuple(links), field=field)


def _names(hop: Hop) -> tuple[str, ...]:
    return tuple(link.name for link in hop.links)


def parting(hops: Iterable[Hop]) -> tuple[str, str] | None:
    """Two relation paths of ``hops`` that part ways (``"post__blog"``, ``"post__editor"``),
    or None if every hop's links are the first links of the longest one."""
    ordered = sorted(hops, key=lambda hop: -hop.depth)
    if not ordered:
        return None
    longest = _names(ordered[0])
    for hop in ordered[1:]:
        names = _names(hop)
        if names != longest[: len(names)]:
            split = next(i for i, name in enumerate(names) if name != longest[i])
            return "__".join(longest[: split + 1]), "__".join(names[: split + 1])
    return None


@dataclass(frozen=True)
class Chain:
    """The relations a tracker's related paths follow outward from its model, depth by depth.

    Depth ``d`` (1 to :attr:`depth`) is the model ``links[d - 1]`` points to.
    Invariant: every hop's links are the first links of ``links``
    (:func:`parting` finds none).
    """

    links: tuple[models.Field, ...]
    hops: tuple[Hop, ...]

    @classmethod
    def of(cls, hops: Iterable[Hop]) -> Chain:
        hops = tuple(hops)
        if not hops or parting(hops) is not None:
            raise PathError(f"{[h.path for h in hops]}: not one chain of relations")
        return cls(max(hops, key=lambda hop: hop.depth).links, hops)

    @property
    def depth(self) -> int:
        return len(self.links)

    def model(self, depth: int) -> type[models.Model]:
        """The model at ``depth``."""
        return concrete_model(related_model(self.links[depth - 1]))

    def middles(self) -> list[type[models.Model]]:
        """The models in the middle of the paths, nearest first."""
        return [self.model(depth) for depth in range(1, self.depth + 1)]

    def reads(self, depth: int) -> list[models.Field]:
        """The columns of the model at ``depth`` the paths read: their own, then the next link."""
        fields = [hop.field for hop in self.hops if hop.depth == depth]
        if depth < self.depth:
            fields.append(self.links[depth])
        unique: dict[str, models.Field] = {}
        for field in fields:
            unique.setdefault(field.attname, field)
        return list(unique.values())

    def key_column(self, depth: int) -> str:
        """The column of the model at ``depth`` that the relation before it points to."""
        return target_field(self.links[depth - 1]).attname

    def lookup(self, depth: int) -> str:
        """The lookup from the source rows to the :meth:`key_column` of the rows at ``depth``."""
        names = [link.name for link in self.links[: depth - 1]]
        return "__".join([*names, self.links[depth - 1].attname])

    def below(self, depth: int) -> list[Hop]:
        """The paths read at ``depth`` or deeper: those a change at ``depth`` can alter."""
        return [hop for hop in self.hops if hop.depth >= depth]

    def above(self, depth: int) -> list[Hop]:
        """The paths read nearer than ``depth``."""
        return [hop for hop in self.hops if hop.depth < depth]
