"""Many-to-many through models: memberships counted through every route Django writes them.

``counters.track("group_members", User.groups.through, key="group", ...)`` counts the
rows of a through model, one per membership. A through model is tracked like any model
(:mod:`counters.tracking.routes`): its saves are counted, and its delete receivers make
the deletion collector send ``pre_delete``/``post_delete`` for each through row it
deletes (it no longer fast-deletes them), so deleting either end, one row or a queryset,
counts the memberships that went, only those that existed.

The related managers (``user.groups``, ``group.user_set``) write through the through
model's default manager: ``remove()``, ``clear()`` and ``set()`` delete with a counted
``delete()``, which locks and reads the rows it deletes. An explicit ``through=`` model
must have a counted default manager (``counters.E013``); ``add()`` inserts with its
counted ``bulk_create()``. An auto-created through model has Django's plain manager:
:func:`prepare` gives it a counted one (:class:`ThroughQuerySet`) before ``track()``
checks it, so its own ``update()``, ``delete()`` and ``bulk_create()`` are counted too.
Its ``add()`` inserts with ``bulk_create(ignore_conflicts=True)``, which skips the pairs
that exist: that one is counted by the :data:`~django.db.models.signals.m2m_changed`
receiver (:func:`changed`). ``pre_add`` locks the rows of the m2m field's own side (the
same row for every add of a pair, from either side, so racing adds queue) and reads the
pairs that exist; ``post_add`` reads back the rows inserted and counts them. Both run
in Django's transaction of the ``add()``.

An auto-created through of a symmetrical many-to-many (``ManyToManyField("self")``) is
refused (``counters.E057``): Django adds its mirror rows without signals.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from typing import Any

from django.db import NotSupportedError, connections, models, transaction
from django.db.models.deletion import Collector
from django.db.models.signals import m2m_changed

from counters.base.context import already_counted, is_paused
from counters.base.utils import batched, model_field
from counters.tracking.counting import rows_changed
from counters.tracking.queryset import CountedManager, CountedQuerySet
from counters.tracking.rows import CHUNK, locked_rows, plain
from counters.tracking.trackers import trackers_for

#: The check id of a through model whose writes cannot all be counted.
CHECK_ID = "counters.E057"

#: Connection attribute: ``{(through, source value, targets): targets to insert}`` of the
#: ``add()`` calls between their ``pre_add`` and ``post_add``.
_ADDING = "_counters_m2m_adding"


def auto_through(model: type[models.Model]) -> bool:
    """Whether ``model`` is the through model Django created for a many-to-many field."""
    return bool(model._meta.auto_created) and _field(model) is not None


def _field(through: type[models.Model]) -> models.ManyToManyField | None:
    """The many-to-many field whose auto-created through model is ``through``, or None."""
    owner = through._meta.auto_created
    if not isinstance(owner, type):
        return None
    for field in owner._meta.local_many_to_many:
        if field.remote_field.through is through:
            return field
    return None


def refusal(model: type[models.Model]) -> str | None:
    """E057: why the writes of through model ``model`` cannot all be counted, or None."""
    field = _field(model) if model._meta.auto_created else None
    if field is not None and field.remote_field.symmetrical:
        return (
            f"{model._meta.label} is the through model of the symmetrical many-to-many "
            f"{field.model._meta.label}.{field.name}: Django adds its mirror rows without "
            "signals, so they cannot be counted; use symmetrical=False or an explicit "
            "through model with a counters.CountedManager"
        )
    return None


# -- the counted manager of an auto-created through model ---------------------------


class ThroughQuerySet(CountedQuerySet):
    """The queryset of an auto-created through model: counted, and its ``add()`` too.

    ``bulk_create(ignore_conflicts=True)`` is Django's insert of a related
    manager's ``add()``: between its ``pre_add`` and ``post_add``, it inserts
    and :func:`changed` counts. Anywhere else it is refused, as
    :class:`~counters.CountedQuerySet` refuses it.
    """

    def bulk_create(
        self,
        objs: Iterable[Any],
        batch_size: int | None = None,
        ignore_conflicts: bool = False,
        update_conflicts: bool = False,
        update_fields: Collection[str] | None = None,
        unique_fields: Collection[str] | None = None,
    ) -> list[Any]:
        objs = list(objs)
        if not objs or (ignore_conflicts and _pending(self.model, objs, self.db)):
            return models.QuerySet.bulk_create(self, objs, batch_size, ignore_conflicts=True)
        return super().bulk_create(
            objs, batch_size, ignore_conflicts, update_conflicts, update_fields, unique_fields
        )


def _pending(through: type[models.Model], objs: list[Any], using: str) -> bool:
    """Whether ``objs`` are the rows of an ``add()`` between its ``pre_add`` and ``post_add``."""
    adding = connections[using].__dict__.get(_ADDING)
    field = _field(through)
    if not adding or field is None:
        return False
    names = (field.m2m_field_name(), field.m2m_reverse_field_name())
    for source, target in (names, names[::-1]):
        first = model_field(through, source).attname
        second = model_field(through, target).attname
        values = {getattr(obj, first) for obj in objs}
        if len(values) == 1:
            targets = tuple(sorted(getattr(obj, second) for obj in objs))
            if (through, values.pop(), targets) in adding:
                return True
    return False


class ThroughManager(CountedManager.from_queryset(ThroughQuerySet)):  # type: ignore[misc]
    """The default manager :func:`prepare` gives an auto-created through model."""


def prepare(model: type[models.Model]) -> None:
    """Give auto-created through model ``model`` a counted default manager; idempotent.

    Its rows are written by Django's related managers through it. Without
    trackers a :class:`~counters.CountedQuerySet` behaves as Django's.
    """
    if not auto_through(model):
        return
    meta = model._meta
    current = meta.default_manager
    if current is None or isinstance(current.get_queryset(), CountedQuerySet):
        return
    name = current.name
    meta.local_managers = [m for m in meta.local_managers if m.name != name]
    manager = ThroughManager()
    manager.auto_created = True
    model.add_to_class(name, manager)  # expires the managers cached on the model's options


def install(model: type[models.Model]) -> None:
    """Count the ``add()`` and the deletes of auto-created through model ``model``."""
    if auto_through(model):
        uid = f"counters:m2m:{model._meta.label}"
        m2m_changed.connect(changed, sender=model, dispatch_uid=uid)
        install_collector()


# -- the deletion collector ----------------------------------------------------------


def _counted_through(model: type[models.Model]) -> bool:
    return bool(model._meta.auto_created) and bool(trackers_for(model))


def _locked_deletes(collector: Collector) -> dict[type[models.Model], list[dict[str, Any]]]:
    """The rows of tracked auto-created through models ``collector`` will delete, locked.

    Django sends no ``pre_delete``/``post_delete`` for auto-created models: their rows,
    collected (a cascade from either end, a ``delete()``) or fast-deleted, are read here.
    Rows a counted ``delete()`` counts itself are left out.
    """
    using = collector.using
    found: dict[type[models.Model], list[dict[str, Any]]] = {}
    for model, instances in collector.data.items():
        if not _counted_through(model):
            continue
        pks = sorted(o.pk for o in instances if not already_counted(model, o.pk))
        for chunk in batched(pks, CHUNK):
            locked = locked_rows(plain(model, using).filter(pk__in=chunk))
            found.setdefault(model, []).extend(row for _, row in locked)
    for qs in collector.fast_deletes:
        model = qs.model
        if isinstance(qs, models.QuerySet) and _counted_through(model):
            rows = [row for pk, row in locked_rows(qs) if not already_counted(model, pk)]
            found.setdefault(model, []).extend(rows)
    return found


def install_collector() -> None:
    """Count the rows of tracked auto-created through models the deletion collector deletes."""
    if getattr(Collector.delete, "_counters_m2m", False):
        return
    original = Collector.delete

    @functools.wraps(original)
    def delete(self: Collector) -> Any:
        models_ = [*self.data, *(getattr(qs, "model", None) for qs in self.fast_deletes)]
        if is_paused() or not any(m is not None and _counted_through(m) for m in models_):
            return original(self)
        with transaction.atomic(using=self.using, savepoint=False):
            old = _locked_deletes(self)
            result = original(self)
            for model, rows in old.items():
                if rows:
                    rows_changed.send(sender=model, old=rows, new=[], using=self.using)
        return result

    delete._counters_m2m = True  # type: ignore[attr-defined]
    Collector.delete = delete  # type: ignore[method-assign]


# -- add() --------------------------------------------------------------------------


def _ends(
    through: type[models.Model], reverse: bool
) -> tuple[models.ForeignKey, models.ForeignKey, models.ForeignKey]:
    """``(source, target, own)``: the through's foreign keys to the manager's instance, to
    the objects added, and to the model of the many-to-many field."""
    field = _field(through)
    if field is None:  # pragma: no cover - install() connects auto-created throughs only
        raise NotSupportedError(f"{through._meta.label} is not an auto-created through model")
    own = through._meta.get_field(field.m2m_field_name())
    other = through._meta.get_field(field.m2m_reverse_field_name())
    source, target = (other, own) if reverse else (own, other)
    return source, target, own  # type: ignore[return-value]


def changed(
    sender: type[models.Model],
    instance: models.Model,
    action: str,
    reverse: bool,
    pk_set: set[Any] | None,
    using: str,
    **kwargs: Any,
) -> None:
    """``m2m_changed`` of an auto-created through model: count the rows ``add()`` inserts."""
    if action not in ("pre_add", "post_add") or not pk_set or is_paused():
        return
    if not trackers_for(sender):
        return
    source, target, own = _ends(sender, reverse)
    value = getattr(instance, source.target_field.attname)
    targets = sorted(pk_set)
    adding: dict[Any, set[Any]] = connections[using].__dict__.setdefault(_ADDING, {})
    call = (sender, value, tuple(targets))
    pairs = plain(sender, using).filter(**{source.attname: value, f"{target.attname}__in": targets})
    if action == "pre_add":
        # every add of a pair locks the row of the field's own side first: racing adds
        # of one pair, from either side, queue here and the second sees the first's row
        side: Any = instance._meta.concrete_model if own is source else own.related_model
        ends = [value] if own is source else targets
        column = own.target_field.attname
        rows = plain(side, using).filter(**{f"{column}__in": ends})
        list(rows.order_by(column).select_for_update().values_list(column))
        existing = set(pairs.select_for_update().values_list(target.attname, flat=True))
        adding[call] = set(targets) - existing
        return
    inserted = adding.pop(call, None)
    if not inserted:
        return
    new = locked_rows(pairs.filter(**{f"{target.attname}__in": sorted(inserted)}))
    if new:
        rows_changed.send(sender=sender, old=[], new=[row for _, row in new], using=using)
