"""The trackers: one :class:`Tracker` per ``track()`` declaration, and who tracks what.

Every counted path reads this registry and nothing above it: which trackers
a model has (:func:`trackers_for`), which of its fields they read
(:func:`tracked_fields`) and whether a change of some fields can move a
counter (:func:`touches`). Invariant: a tracker is added once, after its
declaration was checked and its counter registered, and never changes.
A tracker's truth, read from its source rows for rebuilds and audits, is
its :class:`QueryTruth`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from django.db import DEFAULT_DB_ALIAS, models
from django.db.models import Q

from counters.base import registry
from counters.base.utils import concrete_model, target_field
from counters.tracking.paths import Chain, Hop
from counters.tracking.where import PLAIN_TYPES, Predicate, Row, is_expression, native_type


@dataclass(frozen=True, eq=False)
class Tracker:
    """One ``track()`` declaration, resolved to fields."""

    #: Whether :class:`InsertPlan` can count a new row from its values (a key of one column).
    plannable: ClassVar[bool] = True

    name: str
    model: type[models.Model]
    key: str
    into: str
    where: Q | None
    amount: str | None
    key_field: models.Field
    amount_field: models.Field | None
    condition: Predicate
    attnames: tuple[str, ...]
    #: The related paths read (:mod:`counters.tracking.paths`), the key's first if it has one.
    related: tuple[Hop, ...] = ()

    @cached_property
    def key_name(self) -> str:
        """The key's name in a row and in a lookup: its attname, or its related path."""
        if self.related and self.related[0].path == self.key:
            return self.key
        return self.key_field.attname

    @property
    def related_key(self) -> bool:
        return bool(self.related) and self.related[0].path == self.key

    @property
    def chain(self) -> Chain:
        """The relations its related paths follow (raises ``PathError`` if it has none)."""
        found = _chains.get(self)
        return found if found is not None else Chain.of(self.related)

    @property
    def signature(self) -> tuple:
        return (self.model._meta.label, self.key, self.into, self.where, self.amount)

    @property
    def spec(self) -> registry.CounterSpec:
        return registry.get_spec(self.name)

    @property
    def parent_model(self) -> type[models.Model] | None:
        """The model ``key`` points to (its counters exist for each of its rows), else None."""
        remote = self.key_field.remote_field
        return remote.model if remote is not None else None

    def contribution(self, row: Row) -> tuple[Any, int] | None:
        """``(key, what the row adds)``, or None if it adds nothing."""
        key = row[self.key_name]
        if key is None or not self.condition(row):
            return None
        return key, self.adds(row)

    def adds(self, row: Row) -> int:
        """What a counted row adds: 1, or its amount."""
        if self.amount_field is None:
            return 1
        return row[self.amount_field.attname] or 0

    def grouped_totals(self, rows: models.QuerySet, columns: list[str]) -> models.QuerySet:
        """What the counted ones of ``rows`` add up to per value of ``columns``: tuples of
        the columns' values and their total (the truth, in SQL)."""
        if self.where is not None:
            rows = rows.filter(self.where)
        if self.amount_field is None:
            total: Any = models.Count("pk")
        else:
            total = models.Sum(self.amount_field.attname)
        return rows.order_by().values(*columns).annotate(n=total).values_list(*columns, "n")

    def totals(self, rows: Iterable[Row | None]) -> Counter:
        """What ``rows`` add up to per key (keys normalised: ``"5"`` and ``5`` are one)."""
        normalize = self.spec.normalize
        totals: Counter = Counter()
        for row in rows:
            if row is None:
                continue
            found = self.contribution(row)
            if found is not None and found[1]:
                totals[normalize(found[0])] += found[1]
        return totals

    def deltas(self, old: Iterable[Row | None], new: Iterable[Row | None]) -> dict[Any, int]:
        """``new - old`` per key, zeros left out."""
        change = self.totals(new)
        change.subtract(self.totals(old))
        return {key: delta for key, delta in change.items() if delta}

    def add_members(
        self, into: dict[str, int], old: Iterable[Row | None], new: Iterable[Row | None]
    ) -> None:
        """Add ``new - old`` to ``into`` per Redis member (``"<name>:<key>"``), as
        :meth:`deltas` computes it (zeros may be left in ``into``).

        Raises :class:`~counters.base.exceptions.InvalidKey` as
        :meth:`CounterSpec.normalize <counters.base.registry.CounterSpec.normalize>` does.
        """
        member = self.spec.member
        for rows, sign in ((new, 1), (old, -1)):
            for row in rows:
                if row is None:
                    continue
                found = self.contribution(row)
                if found is not None and found[1]:
                    name = member(found[0])
                    into[name] = into.get(name, 0) + sign * found[1]


class QueryTruth:
    """A :class:`~counters.base.registry.TruthSource` computed by SQL from a declaration.

    ``COUNT(*)`` (or ``SUM(amount)``) of the source rows matching ``where``,
    grouped by key (a related key or where is a join: ``post__author``). When
    the key points to a parent model, the keys are the parent's rows in keyset
    order, so counters whose truth is 0 are checked too; otherwise they are the
    keys found in the source rows and in the counter rows.
    """

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
        grouped = tracker.grouped_totals(rows, [column])
        normalize = tracker.spec.normalize
        return {normalize(key): int(n or 0) for key, n in grouped}

    def estimate(self, *, using: str = DEFAULT_DB_ALIAS) -> int:
        parent = self.tracker.parent_model
        if parent is not None:
            return models.QuerySet(parent, using=using).count()
        column = self.tracker.key_name
        return self._rows(using).values(column).distinct().count()


class InsertPlan:
    """Counting an insert of a model, resolved once from its trackers.

    For a model none of whose trackers reads related rows: an insert then
    counts from the instance's own values, read after Django wrote them. The
    plan belongs to one tuple of trackers (:func:`insert_plan` makes a new
    one when the model's trackers change).
    """

    __slots__ = ("attnames", "native", "steps", "trackers")

    def __init__(self, model: type[models.Model], trackers: tuple[Tracker, ...]) -> None:
        self.trackers = trackers
        fields = tracked_fields(model)
        self.attnames = tuple(f.attname for f in fields)
        #: ``(attname, type)`` of the fields whose values of that type are stored as they are.
        self.native = tuple((f.attname, native_type(f)) for f in fields)
        #: Per tracker, what :meth:`Tracker.contribution` reads: the key's attname, the
        #: condition, the amount's attname (None: each row adds 1) and the counter's name.
        self.steps = tuple(
            (
                t.key_name,
                t.condition,
                t.amount_field.attname if t.amount_field is not None else None,
                t.name,
            )
            for t in trackers
        )

    def has_expression(self, values: dict[str, Any]) -> bool:
        """Whether a tracked value in ``values`` (an instance's ``__dict__``) is an expression."""
        for attname in self.attnames:  # (a loop: a set built from a map costs more)
            value = values.get(attname)
            if type(value) not in PLAIN_TYPES and is_expression(value):
                return True
        return False

    def members(self, values: dict[str, Any]) -> dict[str, int] | None:
        """``{member: delta}`` of a row inserted with ``values`` (an instance's ``__dict__``,
        zeros may be left in); None if a tracked value is not of its field's own type (or
        None): convert them with :func:`~counters.tracking.rows.instance_row` first.

        What :meth:`Tracker.add_members` adds for a new row, each tracker's
        steps read once here instead of per call, from ``values`` itself: its
        tracked values are those of the row.
        """
        for attname, native in self.native:
            value = values.get(attname, _ABSENT)
            if type(value) is not native and value is not None:  # missing, or another type
                return None
        members: dict[str, int] = {}
        for key_name, condition, amount, name in self.steps:
            key = values[key_name]
            if key is None or not condition(values):
                continue
            delta = 1 if amount is None else values[amount] or 0
            if delta:
                member = registry.get_spec(name).member(key)
                members[member] = members.get(member, 0) + delta
        return members


_ABSENT = object()
_trackers: dict[str, Tracker] = {}
_by_model: dict[type[models.Model], tuple[Tracker, ...]] = {}
_tracked_fields: dict[type[models.Model], tuple[models.Field, ...]] = {}
_attnames: dict[type[models.Model], tuple[str, ...]] = {}
_names: dict[type[models.Model], frozenset[str]] = {}
#: ``(tracker, depth)``: a tracker whose related paths go through a model at that depth.
Through = tuple[Tracker, int]
#: middle model -> ``(tracker, depth)`` of every tracker whose related paths go through it.
_middles: dict[type[models.Model], tuple[Through, ...]] = {}
#: tracker -> its :class:`Chain`, once it is added.
_chains: dict[Tracker, Chain] = {}
#: concrete model -> the :class:`InsertPlan` of its trackers, or None if one reads related rows.
_plans: dict[type[models.Model], tuple[tuple[Tracker, ...], InsertPlan | None]] = {}


def add_tracker(tracker: Tracker) -> None:
    """Record ``tracker``, and the fields its model's counted paths read from now on."""
    model = tracker.model
    _trackers[tracker.name] = tracker
    _by_model[model] = (*_by_model.get(model, ()), tracker)
    names = {a for t in _by_model[model] for a in t.attnames}
    fields = tuple(f for f in model._meta.concrete_fields if f.attname in names)
    _tracked_fields[model] = fields
    _attnames[model] = tuple(f.attname for f in fields)
    _names[model] = frozenset({f.name for f in fields} | {f.attname for f in fields})
    if tracker.related:
        _chains[tracker] = Chain.of(tracker.related)
        for depth, middle in enumerate(tracker.chain.middles(), 1):
            _middles[middle] = (*_middles.get(middle, ()), (tracker, depth))


def insert_plan(model: type[models.Model]) -> InsertPlan | None:
    """The :class:`InsertPlan` of concrete ``model``; None if it has no trackers or one of
    them reads related rows."""
    trackers = _by_model.get(model)
    if not trackers:
        return None
    found = _plans.get(model)
    if found is None or found[0] is not trackers:  # new, or the trackers changed
        planned = all(t.plannable and not t.related for t in trackers)
        plan = InsertPlan(model, trackers) if planned else None
        found = _plans[model] = (trackers, plan)
    return found[1]


def middle_hops(model: type[models.Model]) -> tuple[Through, ...]:
    """``(tracker, depth)`` of the trackers whose related paths read columns of ``model``."""
    return _middles.get(concrete_model(model), ())


def middle_touched(model: type[models.Model], names: Iterable[str]) -> tuple[Through, ...]:
    """The ``(tracker, depth)`` of :func:`middle_hops` that read one of fields ``names``
    of ``model``: a column of its paths, or the relation to the next model of the chain."""
    found = _middles.get(concrete_model(model))
    if not found:
        return ()
    names = set(names)
    return tuple(
        (tracker, depth)
        for tracker, depth in found
        if any(f.name in names or f.attname in names for f in tracker.chain.reads(depth))
    )


def middle_models() -> tuple[type[models.Model], ...]:
    return tuple(_middles)


def trackers_for(model: type[models.Model]) -> tuple[Tracker, ...]:
    """The trackers whose source is ``model`` (or the concrete model of a proxy)."""
    return _by_model.get(concrete_model(model), ())


def tracked_fields(model: type[models.Model]) -> tuple[models.Field, ...]:
    """The fields a counted path reads from rows of ``model``, in a fixed order."""
    return _tracked_fields.get(concrete_model(model), ())


def tracked_attnames(model: type[models.Model]) -> tuple[str, ...]:
    """The attnames of :func:`tracked_fields`."""
    return _attnames.get(model._meta.concrete_model or model, ())


def touches(model: type[models.Model], names: Iterable[str]) -> bool:
    """Whether changing fields ``names`` (names or attnames) can change a counter."""
    tracked = _names.get(concrete_model(model))
    return tracked is not None and not tracked.isdisjoint(names)


def get_tracker(name: str) -> Tracker:
    return _trackers[name]


def find_tracker(name: str) -> Tracker | None:
    """The tracker named ``name``, or None."""
    return _trackers.get(name)


def all_trackers() -> list[Tracker]:
    return list(_trackers.values())


def tracked_models() -> tuple[type[models.Model], ...]:
    """The concrete models that have trackers, in the order they were first tracked."""
    return tuple(_by_model)
