"""A shard count changed back to one used before, in a process that keeps writing.

Layouts go back and forth between 1 and 8 shards (after 16): each time a layout
already retired and drained is in use again, its flush takes it back, retires the
other and drains it, and a process whose layout is retired refuses repairs while a
layout in use holds deltas its reads miss.
"""

from __future__ import annotations

import random

import pytest

import counters
from counters.base.exceptions import LayoutChangePending
from counters.models import BufferLayout
from counters.verify.rebuild import rebuild_all
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def exact(users) -> dict:
    rows = dict(UnreadCounter.objects.values_list("user_id", "count"))
    return {u.pk: rows.get(u.pk, 0) for u in users}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_shard_count_taken_back_loses_nothing(settings, make_user, seed):
    rng = random.Random(seed)
    users = [make_user() for _ in range(5)]
    settings.COUNTERS_SHARDS = 16
    counters.flush()
    for _ in range(12):
        for _ in range(rng.randrange(1, 6)):
            Notification.objects.create(recipient=rng.choice(users), verb="v")
        settings.COUNTERS_SHARDS = rng.choice([1, 8])
        assert counters.flush().layouts_pending == []
        assert exact(users) == {u.pk: truth(u) for u in users}
    in_use = BufferLayout.objects.filter(retired_at__isnull=True)
    assert list(in_use.values_list("shards", flat=True)) == [settings.COUNTERS_SHARDS]


def test_a_process_on_a_retired_layout_repairs_nothing_until_its_flush_takes_it_back(
    settings, make_user
):
    users = [make_user() for _ in range(4)]
    settings.COUNTERS_SHARDS = 1
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # repairs confirm drift 0.6 s apart
    settings.COUNTERS_AUTO_REBUILD = False
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    settings.COUNTERS_SHARDS = 8
    counters.flush()  # 1 shard retired and drained
    for user in users:
        Notification.objects.create(recipient=user, verb="v")  # pending under 8 shards
    settings.COUNTERS_SHARDS = 1  # back, before any push or flush under it
    UnreadCounter.objects.filter(user=users[0]).update(count=9)  # a drift to repair
    with pytest.raises(LayoutChangePending):
        rebuild_all()
    assert [stored(u) for u in users] == [9, 1, 1, 1]
    assert counters.flush().layouts_pending == []
    assert exact(users) == {users[0].pk: 10, **{u.pk: 2 for u in users[1:]}}
    rebuild_all()
    counters.flush()
    assert [truth(u) for u in users] == [2, 2, 2, 2]
    assert exact(users) == {u.pk: 2 for u in users}
