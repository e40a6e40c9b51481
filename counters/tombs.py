"""Counters keyed by a natural key: a parent deleted and created again starts from 0.

A counter row goes with its parent (the foreign key cascades), but the
deltas of the parent's deletion (its children's ``-1``) and any delta not
yet flushed are still buffered for its key. With an auto-increment key that
key never comes back and the flush drops them. A natural key (a foreign key
``to_field="code"``) can come back: a parent created again with the same
code before the flush would inherit them (3 true children, ``-9`` read and
stored after 12 had been flushed and deleted).

So for such counters :class:`~counters.models.Tombstone` keeps, per key,
what belongs to the deleted parent and is not in the buffer: the value of
its counter row when it is deleted (read under the row's lock, in the
deleting transaction), plus every delta the flush drops because the parent
is gone. Invariant: ``row + tombstone + buffered`` is the truth of the key;
the tombstone nets to 0 once every delta of the deleted parent is in, and
is then deleted. A parent created again takes its key's tombstone and adds
its value to the buffer, in one transaction: the old deltas then sum to 0
and the new counter counts only the new parent's children.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from django.db import connections, models, transaction
from django.db.models.fields import AutoFieldMixin
from django.db.models.signals import post_save, pre_delete

from . import registry
from .registry import CounterSpec
from .utils import batched, concrete_model, target_field

logger = logging.getLogger(__name__)


def reusable(spec: CounterSpec) -> bool:
    """Whether ``spec`` is keyed by a parent whose key values can be used again."""
    if spec.target_model is None:
        return False
    return not isinstance(target_field(spec.key_model_field), AutoFieldMixin)


def connect(parent: type[models.Model]) -> None:
    """Keep tombstones for the counters keyed by ``parent``'s natural key; idempotent."""
    uid = f"counters:{parent._meta.label}:tombstones"
    pre_delete.connect(parent_deleted, sender=parent, dispatch_uid=f"{uid}:pre_delete")
    post_save.connect(parent_created, sender=parent, dispatch_uid=f"{uid}:post_save")


def _specs(parent: type[models.Model]) -> list[CounterSpec]:
    model = concrete_model(parent)
    return [
        s
        for s in registry.all_specs()
        if reusable(s) and s.target_model is not None and concrete_model(s.target_model) is model
    ]


def _key(spec: CounterSpec, parent: models.Model) -> Any:
    return getattr(parent, target_field(spec.key_model_field).attname)


def parent_deleted(
    sender: type[models.Model], instance: models.Model, using: str, **kwargs: Any
) -> None:
    """``pre_delete`` of a parent: its counter rows' values go to their tombstones."""
    for spec in _specs(sender):
        key = _key(spec, instance)
        if key is None:
            continue
        value = (
            spec.model._base_manager.using(using)
            .select_for_update()
            .filter(**{spec.key_attname: key})
            .values_list(spec.value_field, flat=True)
            .first()
        )
        if value:
            keep(spec, {key: value}, using)


def parent_created(
    sender: type[models.Model], instance: models.Model, created: bool, using: str, **kwargs: Any
) -> None:
    """``post_save`` of a new parent: its key's tombstones go back to the buffer."""
    if not created:
        return
    from .models import Tombstone
    from .writes import add

    for spec in _specs(sender):
        key = _key(spec, instance)
        if key is None:
            continue
        text = str(spec.normalize(key))
        with transaction.atomic(using=using):
            found = (
                Tombstone.objects.using(using)
                .select_for_update()
                .filter(counter=spec.name, key=text)
                .first()
            )
            if found is None:
                continue
            found.delete()
            if found.value:
                add(spec.name, key, found.value, using=using)
                logger.info(
                    "%s:%s created again: %+d of the deleted one back to the buffer",
                    spec.name,
                    text,
                    found.value,
                )


def fold(spec: CounterSpec, keys: list[Any], using: str) -> int:
    """Add the tombstones of ``keys`` (whose counter rows exist) to their rows; how many.

    For a parent created again without ``post_save`` (``bulk_create()``), or
    whose tombstone was written after it was created (a flush that found it
    gone just before): the flush that applies to its row takes the tombstone
    in. Call inside a transaction.
    """
    from .models import Tombstone

    texts = {str(spec.normalize(k)): k for k in keys}
    rows = spec.model._base_manager.using(using)
    folded = 0
    for chunk in batched(sorted(texts), 500):
        found = list(
            Tombstone.objects.using(using)
            .select_for_update()
            .filter(counter=spec.name, key__in=chunk)
            .order_by("key")
        )
        for tomb in found:
            rows.filter(**{spec.key_attname: texts[tomb.key]}).update(
                **{spec.value_field: models.F(spec.value_field) + tomb.value}
            )
            tomb.delete()
            folded += 1
    return folded


def keep(spec: CounterSpec, values: Mapping[Any, int], using: str) -> None:
    """Add ``values`` ({key: value}) to the tombstones of ``spec``; those at 0 go.

    Call inside a transaction. Keys in ascending order, so concurrent
    callers queue on each other and never deadlock.
    """
    from .models import Tombstone

    rows = sorted((str(spec.normalize(k)), v) for k, v in values.items() if v)
    if not rows:
        return
    conn = connections[using]
    if conn.vendor not in ("postgresql", "sqlite"):
        _keep_generic(spec, rows, using)
        return
    qn = conn.ops.quote_name
    table = qn(Tombstone._meta.db_table)
    with conn.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (counter, {qn('key')}, value) "
            f"VALUES {', '.join(['(%s, %s, %s)'] * len(rows))} "
            f"ON CONFLICT (counter, {qn('key')}) "
            f"DO UPDATE SET value = {table}.value + excluded.value",
            [p for key, value in rows for p in (spec.name, key, value)],
        )
    Tombstone.objects.using(using).filter(
        counter=spec.name, key__in=[k for k, _ in rows], value=0
    ).delete()


def _keep_generic(spec: CounterSpec, rows: list[tuple[str, int]], using: str) -> None:
    from .models import Tombstone

    tombs = Tombstone.objects.using(using)
    for key, value in rows:
        found = tombs.select_for_update().filter(counter=spec.name, key=key).first()
        if found is None:
            tombs.create(counter=spec.name, key=key, value=value)
        elif found.value + value:
            tombs.filter(pk=found.pk).update(value=models.F("value") + value)
        else:
            found.delete()
