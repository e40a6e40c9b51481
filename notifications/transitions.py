"""Counted state changes of notifications.

One rule for every path: inside a transaction, lock the rows the path will
change, read their unread state, change them, and emit ``after - before``
unread per recipient. Racing callers queue on the row locks and the second
one sees the first one's result, so a change is counted once. On SQLite,
where ``SELECT ... FOR UPDATE`` does not exist, write transactions are
serialized by the database (``transaction_mode = IMMEDIATE``) to the same effect.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from django.db import NotSupportedError, connections, models, router, transaction

import counters
from counters.registry import get_spec
from counters.utils import batched

from .apps import UNREAD_COUNTER

if TYPE_CHECKING:
    from .models import Notification

#: Fields whose change can change a recipient's unread count.
COUNTED_FIELDS = frozenset({"is_read", "recipient", "recipient_id"})

#: Largest IN list of primary keys in one statement.
CHUNK = 2000

_MISSING = object()


def unread_by_recipient(rows: Iterable[tuple[Any, bool]]) -> Counter:
    """{recipient_id: unread rows} from (recipient_id, is_read) pairs.

    Recipient ids are normalised like the counter's keys (``"5"`` and ``5`` are
    one recipient), so a before and an after state compare equal when no row
    changed recipient.
    """
    unread = Counter(recipient for recipient, is_read in rows if not is_read)
    normalize = get_spec(UNREAD_COUNTER).normalize
    normalized: Counter = Counter()
    for recipient, count in unread.items():
        normalized[normalize(recipient)] += count
    return normalized


def emit(before: Counter, after: Counter, using: str) -> None:
    """Send ``after - before`` per recipient to the unread counter (after COMMIT)."""
    deltas = Counter(after)
    deltas.subtract(before)
    changed = {recipient: delta for recipient, delta in deltas.items() if delta}
    if changed:
        counters.add_many(UNREAD_COUNTER, changed, using=using)


def _plain(qs: models.QuerySet) -> models.QuerySet:
    """An uncounted queryset on the same model and database (for the inner writes)."""
    return models.QuerySet(qs.model, using=qs.db)


def _locked_state(qs: models.QuerySet) -> list[tuple[Any, Any, bool]]:
    """(pk, recipient_id, is_read) of the rows of ``qs``, locked until the transaction ends.

    Only the notification rows are locked (``FOR UPDATE OF`` its own table), never
    rows of joined tables: PostgreSQL refuses to lock the nullable side of an outer
    join (a filter on the nullable ``actor``), and a joined user must stay free.
    """
    of = ("self",) if connections[qs.db].features.has_select_for_update_of else ()
    locked = qs.select_for_update(of=of).order_by("pk")
    return list(locked.values_list("pk", "recipient_id", "is_read"))


def _recipient_id(value: Any) -> Any:
    return getattr(value, "pk", value)


def _after_state(rows, kwargs: dict[str, Any], plain: models.QuerySet, pks: list):
    """Unread state after ``update(**kwargs)``: computed if plain values, else re-read."""
    is_read = kwargs.get("is_read", _MISSING)
    recipient = kwargs.get("recipient", kwargs.get("recipient_id", _MISSING))
    simple_read = is_read is _MISSING or isinstance(is_read, bool)
    simple_recipient = recipient is _MISSING or not hasattr(recipient, "resolve_expression")
    if simple_read and simple_recipient:
        return [
            (
                old_recipient if recipient is _MISSING else _recipient_id(recipient),
                old_read if is_read is _MISSING else is_read,
            )
            for _, old_recipient, old_read in rows
        ]
    after = []
    for chunk in batched(pks, CHUNK):
        after.extend(plain.filter(pk__in=chunk).values_list("recipient_id", "is_read"))
    return after


def counted_update(qs: models.QuerySet, kwargs: dict[str, Any]) -> int:
    """``QuerySet.update()`` that counts changes of ``is_read`` and ``recipient``."""
    if qs.query.is_sliced:
        raise TypeError("Cannot update a query once a slice has been taken.")
    using = qs.db
    plain = _plain(qs)
    with transaction.atomic(using=using):
        rows = _locked_state(qs)
        if not rows:
            return 0
        pks = [pk for pk, _, _ in rows]
        changed = 0
        for chunk in batched(pks, CHUNK):
            changed += plain.filter(pk__in=chunk).update(**kwargs)
        after = _after_state(rows, kwargs, plain, pks)
        emit(
            unread_by_recipient((r, read) for _, r, read in rows), unread_by_recipient(after), using
        )
    return changed


def counted_delete(qs: models.QuerySet) -> tuple[int, dict[str, int]]:
    """``QuerySet.delete()`` that counts -1 per unread row deleted."""
    if qs.query.is_sliced:
        raise TypeError("Cannot use 'limit' or 'offset' with delete().")
    using = qs.db
    plain = _plain(qs)
    total = 0
    per_model: Counter = Counter()
    with transaction.atomic(using=using):
        rows = _locked_state(qs)
        for chunk in batched([pk for pk, _, _ in rows], CHUNK):
            deleted, by_model = plain.filter(pk__in=chunk).delete()
            total += deleted
            per_model.update(by_model)
        emit(unread_by_recipient((r, read) for _, r, read in rows), Counter(), using)
    return total, dict(per_model)


def counted_instance_delete(obj: Notification, using: str | None):
    using = using or router.db_for_write(type(obj), instance=obj)
    if obj.pk is None:
        return models.Model.delete(obj, using=using)
    with transaction.atomic(using=using):
        rows = _locked_state(_plain_for(obj, using).filter(pk=obj.pk))
        result = models.Model.delete(obj, using=using)
        emit(unread_by_recipient((r, read) for _, r, read in rows), Counter(), using)
    return result


def _plain_for(obj: Notification, using: str) -> models.QuerySet:
    return models.QuerySet(type(obj), using=using)


def counted_save(obj: Notification, save: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """``Model.save()`` that counts inserts, and changes made through stale instances."""
    using = kwargs.get("using") or router.db_for_write(type(obj), instance=obj)
    update_fields = kwargs.get("update_fields")
    if update_fields is not None:
        update_fields = set(update_fields)
        if COUNTED_FIELDS.isdisjoint(update_fields):
            save(*args, **kwargs)
            return
    if obj.pk is None:
        save(*args, **kwargs)
        emit(Counter(), unread_by_recipient([(obj.recipient_id, obj.is_read)]), using)
        return
    with transaction.atomic(using=using):
        rows = _locked_state(_plain_for(obj, using).filter(pk=obj.pk))
        save(*args, **kwargs)
        if rows and update_fields is not None:
            _, old_recipient, old_read = rows[0]
            recipient = (
                obj.recipient_id if {"recipient", "recipient_id"} & update_fields else old_recipient
            )
            is_read = obj.is_read if "is_read" in update_fields else old_read
        else:
            recipient, is_read = obj.recipient_id, obj.is_read
        emit(
            unread_by_recipient((r, read) for _, r, read in rows),
            unread_by_recipient([(recipient, is_read)]),
            using,
        )


def counted_bulk_create(qs: models.QuerySet, objs, *args: Any, **kwargs: Any):
    """``bulk_create()`` that counts +1 per unread row inserted."""
    if kwargs.get("ignore_conflicts") or kwargs.get("update_conflicts"):
        raise NotSupportedError(
            "Notification.objects.bulk_create() cannot count rows skipped or updated on "
            "conflict; insert without ignore_conflicts/update_conflicts."
        )
    objs = list(objs)
    created = models.QuerySet.bulk_create(qs, objs, *args, **kwargs)
    emit(Counter(), unread_by_recipient((o.recipient_id, o.is_read) for o in objs), qs.db)
    return created


def notify(
    qs: models.QuerySet, recipients: Iterable[Any], *, batch_size: int, **fields: Any
) -> int:
    """Insert one notification per recipient in batches, in one transaction.

    Deltas of all batches add up in the transaction's outbox, so each recipient
    gets one aggregated delta when it commits.
    """
    model = qs.model
    total = 0
    with transaction.atomic(using=qs.db):
        for chunk in batched(recipients, batch_size):
            objs = [model(recipient_id=_recipient_id(r), **fields) for r in chunk]
            counted_bulk_create(qs, objs, batch_size=batch_size)
            total += len(objs)
    return total
