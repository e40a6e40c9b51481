"""The truth of a tracked counter, read from the source rows (for rebuilds and audits).

``COUNT(*)`` (or ``SUM(amount)``) of the source rows matching ``where``,
grouped by key (a related key or where is a join: ``post__author``). When
the key points to a parent model, the keys are the parent's rows in keyset
order, so counters whose truth is 0 are checked too; otherwise they are the
keys found in the source rows and in the counter rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS, models

from counters.base.utils import target_field

if TYPE_CHECKING:
    from counters.tracking.trackers import Tracker


class QueryTruth:
    """A :class:`~counters.base.registry.TruthSource` computed by SQL from a declaration."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def __repr__(self) -> str:
        return f"QueryTruth({self.tracker.name!r})"

    def _rows(self, using: str) -> models.QuerySet:
        # A plain queryset: every row counts, whatever the default manager hides.
        return models.QuerySet(self.tracker.model, using=using)

    def keys_after(
        self, after: Any | None, limit: int, *, using: str = DEFAULT_DB_ALIAS
    ) -> list[Any]:
        parent = self.tracker.parent_model
        if parent is not None:
            column = target_field(self.tracker.key_field).attname
            keys: models.QuerySet[Any, Any] = models.QuerySet(parent, using=using)
            keys = keys.order_by(column)
            if after is not None:
                keys = keys.filter(**{f"{column}__gt": after})
            return list(keys.values_list(column, flat=True)[:limit])
        found = set(self._distinct(self._rows(using), self.tracker.key_name, after, limit))
        spec = self.tracker.spec
        counted: models.QuerySet[Any, Any] = models.QuerySet(spec.model, using=using)
        found.update(self._distinct(counted, spec.key_attname, after, limit))
        return sorted(found)[:limit]

    @staticmethod
    def _distinct(rows: models.QuerySet, column: str, after: Any, limit: int) -> list[Any]:
        rows = rows.filter(**{f"{column}__isnull": False})
        if after is not None:
            rows = rows.filter(**{f"{column}__gt": after})
        return list(rows.order_by(column).values_list(column, flat=True).distinct()[:limit])

    def count_for(self, keys: list[Any], *, using: str = DEFAULT_DB_ALIAS) -> dict[Any, int]:
        tracker = self.tracker
        column = tracker.key_name
        rows = self._rows(using).filter(**{f"{column}__in": keys})
        if tracker.where is not None:
            rows = rows.filter(tracker.where)
        if tracker.amount_field is None:
            total: Any = models.Count("pk")
        else:
            total = models.Sum(tracker.amount_field.attname)
        grouped = rows.order_by().values(column).annotate(n=total).values_list(column, "n")
        normalize = tracker.spec.normalize
        return {normalize(key): int(n or 0) for key, n in grouped}

    def estimate(self, *, using: str = DEFAULT_DB_ALIAS) -> int:
        parent = self.tracker.parent_model
        if parent is not None:
            return models.QuerySet(parent, using=using).count()
        column = self.tracker.key_name
        return self._rows(using).values(column).distinct().count()
