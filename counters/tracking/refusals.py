"""What ``track()`` refuses beyond names and fields: declarations a flush or a counted path
cannot count exactly.

Each function returns the problem as a sentence, or None. ``track()``
raises it as a :class:`~counters.base.exceptions.TrackingError` with its check id
before anything is registered, and the ``counters`` system check
(``manage.py check``) reports the same ids for the declarations registered:
:func:`problems` runs them all again on one tracker.

- ``counters.E013``: a source model whose default manager does not make
  :class:`~counters.CountedQuerySet` querysets (:func:`uncounted_manager`).
- ``counters.E045``, ``counters.E046``: a model sharing the source's rows (see
  :mod:`counters.tracking.routes`) with an uncounted base manager, or an
  uncounted default manager (:func:`route_refusal`).

- ``counters.E056``: a related key or where (``"post__author"``,
  ``"post__blog__owner"``) through a model whose default or base manager is
  not counted (a change of its rows moves the counts of the rows below
  them), with multi-table relatives, through one model twice, or leading
  back to the source model; or paths through two relations of one model
  (:func:`uncounted_middle`).

- ``counters.E050``: the flush creates missing counter rows with the key, the
  value and the other columns' defaults; a NOT NULL column with no default
  (nor a database default) cannot be filled, and every delta of a new key
  would fail. ``auto_now``/``auto_now_add`` columns are filled by the flush
  with the current time, as ``save()`` does.
- ``counters.E051``: a generated column is computed by the database when the
  row is written; a counted path reads rows before and after a change in
  Python and cannot know it.
- ``counters.E052``: a composite primary key; counted paths lock and read
  rows by one primary-key column, and counter rows are keyed by one column.
- ``counters.E053``: two counters adding into one column would each add
  their deltas to it (and each rebuild would fight the other).
- ``counters.E054``: a key whose values are not values of the counter rows'
  key column (a text key into an integer primary key) could never be stored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from django.db import models
from django.db.models.fields import AutoFieldMixin

from counters.base import registry
from counters.base.utils import concrete_model, model_field, stamped, target_field
from counters.tracking.keys import CompositeTracker
from counters.tracking.paths import Chain, parting
from counters.tracking.queryset import CountedQuerySet
from counters.tracking.relatives import sharers
from counters.tracking.trackers import tracked_models

if TYPE_CHECKING:
    from counters.tracking.paths import Hop
    from counters.tracking.trackers import Tracker


def composite_key(model: type[models.Model], role: str) -> str | None:
    """E052: ``model`` has a composite primary key."""
    if not getattr(model._meta, "is_composite_pk", False):
        return None
    return (
        f"{role} model {model._meta.label} has a composite primary key: counted paths lock "
        "and read rows by one primary-key column and counter rows are keyed by one column, "
        "so its rows cannot be counted"
    )


def generated(fields: Iterable[tuple[str, models.Field]]) -> str | None:
    """E051: one of ``fields`` (``(role, field)``) is a generated column."""
    for role, field in fields:
        if getattr(field, "generated", False):
            return (
                f"{role} {field.name!r} is a GeneratedField: the database computes it when a "
                "row is written, so a counted change cannot know its value; use the fields "
                "it is computed from"
            )
    return None


def fillable(field: models.Field) -> bool:
    """Whether a new counter row gets a value for ``field`` without being given one."""
    return (
        field.null
        or field.has_default()
        or field.has_db_default()
        or stamped(field)
        or isinstance(field, AutoFieldMixin)
        or bool(getattr(field, "generated", False))
    )


def unfillable(
    into_model: type[models.Model],
    key_field: models.Field | tuple[models.Field, ...],
    value_field: models.Field,
) -> str | None:
    """E050: a column of ``into_model`` that a new counter row cannot be given."""
    given = (*(key_field if isinstance(key_field, tuple) else (key_field,)), value_field)
    missing = [
        f.name for f in into_model._meta.concrete_fields if f not in given and not fillable(f)
    ]
    if not missing:
        return None
    return (
        f"{into_model._meta.label} has NOT NULL columns without a default "
        f"({', '.join(missing)}): the flush creates a counter row for each new key and "
        "cannot fill them; give them a default (or db_default), or null=True"
    )


def _kind(field: models.Field) -> str:
    target = target_field(field) if field.is_relation else field
    if isinstance(target, models.IntegerField):  # AutoFields too
        return "integer"
    if isinstance(target, (models.CharField, models.TextField)):
        return "text"
    return target.get_internal_type()


def key_mismatch(key_field: models.Field, into_key: models.Field) -> str | None:
    """E054: the values of ``key_field`` are not values of ``into_key``."""
    key_kind, into_kind = _kind(key_field), _kind(into_key)
    if key_kind == into_kind:
        return None
    label = into_key.model._meta.label
    return (
        f"key {key_field.name!r} holds {key_kind} values but {label}.{into_key.name}, which "
        f"keys the counter rows, holds {into_kind} values: such keys could never be stored"
    )


def shared_column(name: str, into_model: type[models.Model], value_field: str) -> str | None:
    """E053: another counter adds into the same column."""
    label = into_model._meta.label
    for spec in registry.all_specs():
        if spec.name != name and spec.model_label == label and spec.value_field == value_field:
            return (
                f"{label}.{value_field} already holds counter {spec.name!r}: two counters "
                "in one column would add into each other; give each its own column"
            )
    return None


def source_fields(tracker: Tracker) -> list[tuple[str, models.Field]]:
    """``(role, field)`` of every source field the declaration reads."""
    fields = [("key", tracker.key_field)]
    if tracker.amount_field is not None:
        fields.append(("amount", tracker.amount_field))
    skip = {f.attname for _, f in fields}
    fields += [
        ("where reads", f)
        for f in tracker.model._meta.concrete_fields
        if f.attname in tracker.attnames and f.attname not in skip
    ]
    return fields


def related_fields(tracker: Tracker) -> list[tuple[str, models.Field]]:
    """``(role, field)`` of every column the declaration's related paths read."""
    return [("related path", hop.field) for hop in tracker.related]


def refusals(
    tracker: Tracker,
    into_model: type[models.Model],
    into_key: models.Field,
    value_field: models.Field,
) -> list[tuple[str, str]]:
    """``(check id, problem)`` of each refusal but E053 that ``tracker`` meets."""
    # A composite key's parts were checked by track(): its rows are given all of them.
    composite = isinstance(tracker, CompositeTracker)
    given = tracker.into_keys if isinstance(tracker, CompositeTracker) else into_key
    found = [
        ("counters.E052", composite_key(tracker.model, "source")),
        ("counters.E052", composite_key(into_model, "into")),
        ("counters.E051", generated(source_fields(tracker) + related_fields(tracker))),
        ("counters.E050", unfillable(into_model, given, value_field)),
    ]
    if not composite and not tracker.key_field.is_relation:
        found.append(("counters.E054", key_mismatch(tracker.key_field, into_key)))
    found.append(("counters.E056", uncounted_middle(tracker.model, tracker.related)))
    return [(check_id, problem) for check_id, problem in found if problem]


def problems(tracker: Tracker) -> list[tuple[str, str]]:
    """``(check id, problem)`` of every refusal above that registered ``tracker`` meets now."""
    spec = tracker.spec
    value_field = model_field(spec.model, spec.value_field)
    found = refusals(tracker, spec.model, spec.key_model_field, value_field)
    shared = shared_column(tracker.name, spec.model, spec.value_field)
    if shared:
        found.append(("counters.E053", shared))
    return found


# -- managers ---------------------------------------------------------------------


def uncounted_manager(model: type[models.Model]) -> str | None:
    """E013: why the default manager of ``model`` does not count its querysets, or None."""
    manager = model._default_manager
    queryset = manager.get_queryset()
    if isinstance(queryset, CountedQuerySet):
        return None
    return (
        f"the default manager {model.__name__}.{manager.name} makes {type(queryset).__name__} "
        "querysets, whose update(), delete() and bulk_create() are not counted: use "
        "objects = counters.CountedManager() (or a manager of a counters.CountedQuerySet "
        "subclass)"
    )


def uncounted_middle(source: type[models.Model], hops: Iterable[Hop]) -> str | None:
    """E056: a related path through a model whose changes are not all counted.

    Every model in the middle of a path (the post and the blog of
    ``post__blog__owner``; not the owner's model at its end) must be counted.
    Paths that part ways (``post__author`` and ``category__visible``, or
    ``post__blog__owner`` and ``post__editor__active``) are refused too: two
    transactions changing a post and a category of the same row would each
    move it with the other's old value. So is a path through one model twice
    (a cycle), or back to the source.
    """
    hops = list(hops)
    if not hops:
        return None
    parted = parting(hops)
    if parted is not None:
        return (
            f"related paths through {parted[0]} and {parted[1]}: paths through two relations "
            "of one model are not counted; use paths along one chain of relations "
            '("post__blog__owner" with "post__published")'
        )
    chain = Chain.of(hops)
    path = max(hops, key=lambda hop: hop.depth).path
    seen: dict[type[models.Model], int] = {concrete_model(source): 0}
    for depth, middle in enumerate(chain.middles(), 1):
        problem = _middle_problem(source, middle, path, seen.get(middle), depth)
        if problem:
            return problem
        seen[middle] = depth
    return None


def _middle_problem(
    source: type[models.Model],
    middle: type[models.Model],
    path: str,
    earlier: int | None,
    depth: int,
) -> str | None:
    """Why ``middle``, at ``depth`` of ``path``, cannot be in the middle of a counted path."""
    label = middle._meta.label
    if middle is source or issubclass(source, middle) or issubclass(middle, source):
        return f"{path!r} leads back to {label}, the source model: not counted"
    if earlier is not None:
        return (
            f"{path!r} goes through {label} twice (at depths {earlier} and {depth}): a path "
            "through one model twice is not counted"
        )
    if middle._meta.parents or any(
        m._meta.parents.get(middle) for m in middle._meta.apps.get_models()
    ):
        return (
            f"{path!r} goes through {label}, which has multi-table relatives: "
            "related paths through them are not counted"
        )
    problem = uncounted_manager(middle)
    if problem is None:
        base = middle._meta.base_manager
        if base.auto_created or isinstance(base.get_queryset(), CountedQuerySet):
            return None
        problem = f"its base manager {label}.{base.name} is not counted"
    return (
        f"{path!r} goes through {label} (at depth {depth}), whose changes move the counts of "
        f"the rows below it: {problem}"
    )


def route_refusal(model: type[models.Model]) -> tuple[str, str] | None:
    """``(check id, problem)`` if a model sharing ``model``'s rows has an uncounted route."""
    for sharer in sharers(model):
        label = sharer._meta.label
        base = sharer._meta.base_manager
        if not base.auto_created and not isinstance(base.get_queryset(), CountedQuerySet):
            return (
                "counters.E045",
                f"the base manager {label}.{base.name} (Meta.base_manager_name) makes "
                f"{type(base.get_queryset()).__name__} querysets: Django's related managers "
                "and SET_NULL/SET()/SET_DEFAULT update rows through it uncounted; give it a "
                "counters.CountedQuerySet",
            )
        if sharer is model:
            continue  # its default manager is E013
        default = sharer._default_manager
        if not isinstance(default.get_queryset(), CountedQuerySet):
            kind = "proxy" if sharer._meta.proxy else "multi-table relative"
            return (
                "counters.E046",
                f"{label}, a {kind} of {model._meta.label}, has the default manager "
                f"{label}.{default.name} making {type(default.get_queryset()).__name__} "
                "querysets, whose update() and bulk_create() change its rows uncounted: "
                "use counters.CountedManager()",
            )
    return None


def other_managers(model: type[models.Model]) -> list[tuple[type[models.Model], str]]:
    """``(sharer, manager name)`` of each uncounted non-default manager of a sharer."""
    found = []
    for sharer in sharers(model):
        if sharer is model:
            continue  # its own managers: see counters.checks.check_trackers
        for manager in sharer._meta.managers:
            if manager.name == sharer._default_manager.name:
                continue
            if not isinstance(manager.get_queryset(), CountedQuerySet):
                found.append((sharer, manager.name))
    return found


def refused_models() -> list[tuple[type[models.Model], str, str]]:
    """``(model, check id, problem)`` of the tracked models :func:`route_refusal` refuses now."""
    found = []
    for model in tracked_models():
        problem = route_refusal(model)
        if problem is not None:
            found.append((model, *problem))
    return found
