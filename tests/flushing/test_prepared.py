"""A flush prepares each batch (grouped by counter, its statement built) before its turn."""

from __future__ import annotations

import threading
from unittest import mock

import pytest
from django.db import connection, transaction

import counters
from counters.buffer.batches import Batch
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.models import FlushBatch
from counters.write import apply
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.usefixtures("redis_backend")
def test_each_batch_is_prepared_outside_its_apply_and_counted_exactly(settings, make_user):
    """Every counter's statement is built before ``apply_batch``; none is built inside it."""
    settings.COUNTERS_FLUSH_LANES = 2
    users = [make_user() for _ in range(24)]
    for i, user in enumerate(users):
        for _ in range(i % 3 + 1):
            Notification.objects.create(recipient=user, verb="v")
    applying = threading.local()
    built = {"outside": 0, "inside": 0}
    seen: list[type] = []
    lock = threading.Lock()
    real_plan, real_apply = apply.plan_postgresql, flusher.apply_batch

    def plan(*args, **kwargs):
        with lock:
            built["inside" if getattr(applying, "on", False) else "outside"] += 1
        return real_plan(*args, **kwargs)

    def apply_batch(batch, using, result):
        with lock:
            seen.append(type(batch.items))
        applying.on = True
        try:
            real_apply(batch, using, result)
        finally:
            applying.on = False

    with (
        mock.patch.object(apply, "plan_postgresql", plan),
        mock.patch.object(flusher, "apply_batch", apply_batch),
    ):
        result = counters.flush()
    shards = {get_buffer().shard_of(f"unread:{u.pk}") for u in users}
    assert result.batches == len(seen) == len(shards)
    assert set(seen) == {apply.Prepared}
    expected = len(shards) if connection.vendor == "postgresql" else 0
    assert built == {"outside": expected, "inside": 0}
    assert result.keys == len(users)
    assert FlushBatch.objects.count() == len(shards)
    assert (
        [stored(u) for u in users]
        == [truth(u) for u in users]
        == [i % 3 + 1 for i in range(len(users))]
    )


@pytest.mark.django_db
def test_prepared_deltas_are_the_deltas_and_apply_as_they_would(make_user):
    """Existing rows, a missing row and a vanished user, with zero and repeated deltas."""
    kept, new, gone = make_user(), make_user(), make_user()
    UnreadCounter.objects.create(user=kept, count=5)
    gone_pk = gone.pk
    gone.delete()
    deltas = {
        f"unread:{kept.pk}": 2,
        f"unread:{new.pk}": 3,
        f"unread:{gone_pk}": 1,
        f"unread:{kept.pk + 10**9}": 0,
    }
    prepared = apply.prepare_deltas(deltas, "default")
    assert prepared == deltas and isinstance(prepared, dict)
    (keyed,) = prepared.grouped.values()
    assert keyed == {kept.pk: 2, new.pk: 3, gone_pk: 1}, "zeros are left out"
    assert hasattr(keyed, "plan") == (connection.vendor == "postgresql")
    with transaction.atomic():
        applied = apply.apply_deltas(prepared, "default")
    assert (applied.keys, applied.deltas, applied.dropped) == (2, 5, 1)
    assert applied.changes == {"unread": {kept.pk: 2, new.pk: 3}}
    rows = dict(UnreadCounter.objects.values_list("user_id", "count"))
    assert rows == {kept.pk: 7, new.pk: 3}


@pytest.mark.django_db
def test_a_prepared_batch_is_grouped_again_for_another_database(make_user):
    """Its statements were built for one connection: another alias gets its own."""
    user = make_user()
    prepared = apply.prepare_deltas({f"unread:{user.pk}": 4}, "default")
    prepared.using = "elsewhere"
    with (
        mock.patch.object(apply, "group_by_spec", wraps=apply.group_by_spec) as grouping,
        transaction.atomic(),
    ):
        applied = apply.apply_deltas(prepared, "default")
    assert grouping.call_count == 1
    assert applied.keys == 1
    assert UnreadCounter.objects.get(user=user).count == 4


def test_a_batch_no_counter_can_read_is_left_unprepared():
    """The error comes from ``apply_batch``, where the batch is isolated as before."""
    batch = Batch(shard=0, batch_id="b", moved_at_ms=0, items={"unread:abc": 1}, recovered=False)
    assert flusher.prepared(batch, "default") is batch
    with pytest.raises(Exception, match="abc"):
        apply.prepare_deltas(batch.items, "default")
