"""A Redis restored from a snapshot taken while a poison batch was being narrowed is behind
the DB: narrowing gives the half kept in flight the shard's next batch sequence number."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from unittest import mock

import pytest
from django.db import OperationalError

import counters
from counters import api, flusher
from counters.exceptions import FlushFailed
from counters.models import BufferEpoch
from counters.status import gather
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]


LEASE = 0.5


@pytest.fixture
def one_shard(settings):
    settings.COUNTERS_SHARDS = 1
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # rebuilds confirm drift 0.6 s apart
    settings.COUNTERS_AUTO_REBUILD = False
    settings.COUNTERS_LEASE_TIMEOUT = LEASE  # the snapshot holds the lease of its flush


def narrow_then_stop(server: RedisServer, poison: str, first: str, path: Path) -> None:
    """Flush once: the batch fails while it holds ``poison``; snapshot Redis just before it
    is narrowed; its first half (with ``first``) applies; the half sent back fails on the
    database, which ends the flush with that half in flight."""
    real_isolate, real_apply = flusher.isolate, flusher.apply_deltas

    def apply(items, using):
        if poison in items:
            raise (ValueError("poison") if first in items else OperationalError("db gone"))
        return real_apply(items, using)

    def isolate(buffer, batch, exc, result):
        if not path.exists():
            server.snapshot(path)  # the whole batch in flight, not narrowed yet
        return real_isolate(buffer, batch, exc, result)

    with (
        mock.patch.object(flusher, "apply_deltas", side_effect=apply),
        mock.patch.object(flusher, "isolate", side_effect=isolate),
        pytest.raises(FlushFailed),
    ):
        counters.flush()


def test_a_restore_from_before_a_narrowing_is_a_loss_not_a_double_count(
    one_shard, snapshot_redis, make_user, tmp_path, caplog
):
    users = [make_user() for _ in range(4)]
    for i, user in enumerate(users):
        for _ in range(i + 2):
            Notification.objects.create(recipient=user, verb="v")
    members = sorted(f"unread:{u.pk}" for u in users)
    by_member = {f"unread:{u.pk}": u for u in users}
    head = [by_member[m] for m in members[:2]]  # the half the narrowing keeps and applies

    old = tmp_path / "before-narrowing.rdb"
    narrow_then_stop(snapshot_redis, members[-1], members[0], old)
    assert [stored(u) for u in head] == [truth(u) for u in head]
    epoch = BufferEpoch.objects.get()
    assert epoch.seq == 2  # batch 1 narrowed to 2 and applied; the half sent back is 3

    snapshot_redis.restart_from(old)  # batch 1 in flight whole again, its sequence at 1
    time.sleep(LEASE)  # the lease of the flush the snapshot was taken in expires
    status = gather(api.get_buffer())["epoch"]
    assert (status["state"], status["shards_lost_since_last_flush"]) == ("lost", [0])
    with caplog.at_level(logging.ERROR, logger="counters.epoch"):
        result = counters.flush()
    assert result.lost_shards == [0]
    assert result.rebuild_needed_since is not None
    errors = [r.getMessage() for r in caplog.records if r.name == "counters.epoch"]
    assert ["went back in time in shard 0" in e for e in errors] == [True]
    # what the restore did: the applied half is back in flight and counts again
    assert [stored(u) for u in head] == [2 * truth(u) for u in head]

    api.rebuild_all()
    assert counters.flush().rebuild_needed_since is None
    assert gather(api.get_buffer())["epoch"]["state"] == "repaired"
    for user in users:
        value = UnreadCounter.objects.get_count(user)
        assert (user.pk, value, stored(user)) == (user.pk, truth(user), truth(user))
    assert sum(truth(u) for u in users) == 14
