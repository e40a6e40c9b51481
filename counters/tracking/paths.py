"""Related keys and conditions: a path of one forward relation, then a column of its model.

``key="post__author"`` counts a comment for the author of its post;
``where=Q(post__published=True)`` counts it while its post is published.
Each such path is a :class:`Hop`: the source's forward foreign key or
one-to-one (``link``, a column of the source's own rows), the model it
points to (``middle``) and the column read there (``field``). A row of the
source carries the value of a hop under its ``path`` (``row["post__author"]``
is the author's key), read with the middle row locked
(:func:`~counters.tracking.rows.with_related`); a change of a middle row
moves the contributions of every row below it at once
(:mod:`counters.tracking.middle`).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.core.exceptions import FieldDoesNotExist
from django.db import models


class PathError(ValueError):
    """A path that cannot be counted: not one forward relation followed by a column."""


@dataclass(frozen=True)
class Hop:
    """``link__field`` from the source model: ``link`` on the source, ``field`` on ``middle``."""

    path: str
    link: models.Field
    field: models.Field

    @property
    def middle(self) -> type[models.Model]:
        model = self.field.model
        return model._meta.concrete_model or model


def _column(model: type[models.Model], name: str, path: str) -> models.Field:
    try:
        field = model._meta.get_field(name)
    except FieldDoesNotExist:
        raise PathError(f"{path!r}: {model._meta.label} has no field {name!r}") from None
    if not isinstance(field, models.Field) or not field.concrete or field.many_to_many:
        raise PathError(f"{path!r}: {name!r} is not a column of {model._meta.label}")
    return field


def resolve(model: type[models.Model], path: str) -> Hop:
    """The hop of ``path`` (``"link__field"``) from ``model``; else raises :class:`PathError`."""
    parts = path.split("__")
    if len(parts) != 2 or not all(parts):
        raise PathError(
            f"{path!r}: a related path is one forward foreign key or one-to-one and a "
            'column of its model ("post__author"); longer paths are not counted'
        )
    link = _column(model, parts[0], path)
    if not (link.many_to_one or link.one_to_one) or not isinstance(link.related_model, type):
        raise PathError(f"{path!r}: {parts[0]!r} is not a forward foreign key or one-to-one")
    field = _column(link.related_model, parts[1], path)
    return Hop(path=f"{link.name}__{field.name}", link=link, field=field)
