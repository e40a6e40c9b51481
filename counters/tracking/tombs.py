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

These are the receivers of a parent's deletion and creation; what every
applier of deltas does with tombstones is in :mod:`counters.write.natural_keys`.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import models, transaction
from django.db.models.signals import post_save, pre_delete

from counters.base import registry
from counters.base.registry import CounterSpec
from counters.base.utils import concrete_model, target_field
from counters.models import Tombstone
from counters.write.add import add
from counters.write.natural_keys import keep, reusable

logger = logging.getLogger(__name__)


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
