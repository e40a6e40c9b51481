"""Redis data loss is detected, reported and (optionally) repaired; status shows the pipeline."""

from __future__ import annotations

import json
import logging
from unittest import mock

import pytest
from django.db import OperationalError

import counters
from counters.base.exceptions import FlushFailed
from counters.buffer.lease import Lease
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.models import BufferEpoch, FlushBatch
from counters.ops.status import gather
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth
from tests.procs import project_env, run_manage
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def four_shards(settings):
    settings.COUNTERS_SHARDS = 4


def restart_empty(server: RedisServer) -> None:
    server.kill()
    server.start()


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_restart_without_persistence_is_detected_once_and_reported(
    four_shards, own_redis, settings, make_user, caplog
):
    settings.COUNTERS_AUTO_REBUILD = False
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    assert counters.flush().lost_shards == []
    assert BufferEpoch.objects.count() == 4
    assert gather(get_buffer())["epoch"]["state"] == "ok"

    Notification.objects.create(recipient=alice, verb="lost with Redis")
    restart_empty(own_redis)
    assert gather(get_buffer())["epoch"]["state"] == "lost"
    with caplog.at_level(logging.ERROR, logger="counters.flushing.epoch"):
        result = counters.flush()
    assert sorted(result.lost_shards) == [0, 1, 2, 3]
    assert "REDIS LOST DATA in 4 shards" in result.summary()
    # One warning for the event, naming every shard it hit; not one per shard.
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert errors[0].startswith("Redis lost the buffer of shards 0, 1, 2, 3 under prefix ")
    assert "counters_rebuild" in errors[0]
    status = gather(get_buffer())["epoch"]
    assert (status["state"], status["losses"]) == ("rebuild_needed", 4)
    again = counters.flush()
    assert again.lost_shards == []  # counted once, not at every flush
    assert again.rebuild_needed_since == result.rebuild_needed_since  # but loud until rebuilt
    assert UnreadCounter.objects.get_count(alice) == truth(alice) - 1  # the loss is real


def test_auto_rebuild_is_on_by_default_and_repairs_what_redis_lost(
    four_shards, own_redis, settings, make_user
):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # the rebuild confirms drift 0.6 s apart
    users = [make_user() for _ in range(3)]
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    for user in users:
        Notification.objects.create(recipient=user, verb="lost with Redis")
    restart_empty(own_redis)
    result = counters.flush()
    assert result.lost_shards
    assert result.rebuild_needed_since is None  # the automatic rebuild completed
    status = gather(get_buffer())
    assert (status["epoch"]["state"], status["epoch"]["rebuild_needed"]) == ("repaired", False)
    assert status["last_flush"]["rebuild_needed_since"] is None
    assert_exact(*users)
    assert [stored(u) for u in users] == [2, 2, 2]


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_status_shows_backlog_in_flight_batches_and_leases(four_shards, own_redis, make_user):
    users = [make_user() for _ in range(6)]
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
    buffer = get_buffer()
    status = gather(buffer)
    assert status["totals"]["pending_keys"] == 6
    assert status["last_flush"] is None
    assert all(s["lag_seconds"] >= 0 for s in status["shards"])
    assert any(s["lag_seconds"] > 0 or s["pending_keys"] for s in status["shards"])

    with (
        mock.patch.object(flusher, "apply_deltas", side_effect=OperationalError("boom")),
        pytest.raises(FlushFailed),
    ):
        counters.flush()
    status = gather(buffer)
    stuck = [s for s in status["shards"] if s["inflight_batch"]]
    assert sum(s["inflight_keys"] for s in stuck) == 6  # every failed shard keeps its batch
    assert status["totals"]["inflight_batches"] == len(stuck)
    assert all(s["inflight_age_seconds"] >= 0 for s in stuck)

    lease = Lease(buffer.client, buffer.key(2, "lease"), 30)
    assert lease.acquire()
    status = gather(buffer)
    assert status["shards"][2]["lease_holder"] == lease.token[:8]
    assert 0 < status["shards"][2]["lease_expires_in"] <= 30
    lease.release()

    result = counters.flush()
    status = gather(buffer)
    assert status["totals"] == {"pending_keys": 0, "inflight_batches": 0, "max_lag_seconds": 0.0}
    assert all(s["lag_seconds"] == 0.0 for s in status["shards"])
    assert status["last_flush"]["keys"] == result.keys
    assert status["ledger"]["batches_in_ledger"] == FlushBatch.objects.count() == result.batches
    assert_exact(*users)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_status_counts_fallback_writes_and_dropped_keys(settings, make_user):
    settings.COUNTERS_REDIS_URL = "redis://127.0.0.1:1/0"
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    Notification.objects.create(recipient=alice, verb="v")
    from counters.ops.status import ledger_status

    ledger = ledger_status()
    assert ledger["fallback_writes"] == 2
    assert ledger["last_fallback_at"] is not None


@pytest.mark.redis
def test_status_command_text_and_json(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    code, out, err = run_manage("counters_status", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["totals"]["pending_keys"] == 1
    assert len(data["shards"]) == 16
    code, out, err = run_manage("counters_status")
    assert code == 0, err
    assert ": 1 pending keys, 0 batches in flight, max lag " in out.splitlines()[0]
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("shard  pending"))
    assert [line.split()[0] for line in lines[header + 1 :]] == [str(s) for s in range(16)]
    code, _, err = run_manage(
        "counters_status", env=project_env(COUNTERS_REDIS_URL="redis://127.0.0.1:1/0")
    )
    assert code == 2  # Redis unreachable: the DB side is shown
    assert err.strip().startswith("Redis unreachable")
