"""Counters keyed by a natural key: what a deleted parent is owed, kept until its key returns.

A counter row goes with its parent (the foreign key cascades), but the
deltas of the parent's deletion (its children's ``-1``) and any delta not
yet flushed are still buffered for its key. With an auto-increment key that
key never comes back and the flush drops them. A natural key (a foreign key
``to_field="code"``) can come back: a parent created again with the same
code before the flush would inherit them.

So for such counters :class:`~counters.models.Tombstone` keeps, per key,
what belongs to the deleted parent and is not in the buffer. Invariant:
``row + tombstone + buffered`` is the truth of the key; the tombstone nets
to 0 once every delta of the deleted parent is in, and is then deleted.
This module is the part every applier of deltas needs (:mod:`counters.write.apply`):
a dropped delta is kept (:func:`keep`), a row applied to takes its key's
tombstone in (:func:`fold`). The receivers of a parent's deletion and
creation are in :mod:`counters.tracking.tombs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import connections, models
from django.db.models.fields import AutoFieldMixin

from counters.base.registry import CounterSpec
from counters.base.utils import batched, on_duplicate_key, target_field
from counters.models import Tombstone


def reusable(spec: CounterSpec) -> bool:
    """Whether ``spec`` is keyed by a parent whose key values can be used again."""
    if spec.target_model is None:
        return False
    return not isinstance(target_field(spec.key_model_field), AutoFieldMixin)


def fold(spec: CounterSpec, keys: list[Any], using: str) -> dict[Any, int]:
    """Add the tombstones of ``keys`` (whose counter rows exist) to their rows.

    Returns ``{key: value added}`` of the tombstones folded (the rows changed
    by that much more than the deltas applied to them).

    For a parent created again without ``post_save`` (``bulk_create()``), or
    whose tombstone was written after it was created (a flush that found it
    gone just before): the flush that applies to its row takes the tombstone
    in. Call inside a transaction.
    """

    texts = {str(spec.normalize(k)): k for k in keys}
    rows = spec.model._base_manager.using(using)
    folded: dict[Any, int] = {}
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
            if tomb.value:
                folded[texts[tomb.key]] = tomb.value
    return folded


def keep(spec: CounterSpec, values: Mapping[Any, int], using: str) -> None:
    """Add ``values`` ({key: value}) to the tombstones of ``spec``; those at 0 go.

    Call inside a transaction. Keys in ascending order, so concurrent
    callers queue on each other and never deadlock.
    """

    rows = sorted((str(spec.normalize(k)), v) for k, v in values.items() if v)
    if not rows:
        return
    conn = connections[using]
    if conn.vendor not in ("postgresql", "sqlite", "mysql"):
        _keep_generic(spec, rows, using)
        return
    qn = conn.ops.quote_name
    table = qn(Tombstone._meta.db_table)
    if conn.vendor == "mysql":
        alias, new = on_duplicate_key(conn)
        upsert = f"{alias} ON DUPLICATE KEY UPDATE value = {table}.value + {new('value')}"
    else:
        upsert = (
            f" ON CONFLICT (counter, {qn('key')}) "
            f"DO UPDATE SET value = {table}.value + excluded.value"
        )
    with conn.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (counter, {qn('key')}, value) "
            f"VALUES {', '.join(['(%s, %s, %s)'] * len(rows))}{upsert}",
            [p for key, value in rows for p in (spec.name, key, value)],
        )
    Tombstone.objects.using(using).filter(
        counter=spec.name, key__in=[k for k, _ in rows], value=0
    ).delete()


def _keep_generic(spec: CounterSpec, rows: list[tuple[str, int]], using: str) -> None:

    tombs = Tombstone.objects.using(using)
    for key, value in rows:
        found = tombs.select_for_update().filter(counter=spec.name, key=key).first()
        if found is None:
            tombs.create(counter=spec.name, key=key, value=value)
        elif found.value + value:
            tombs.filter(pk=found.pk).update(value=models.F("value") + value)
        else:
            found.delete()
