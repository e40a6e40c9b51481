"""A Redis that loses its data before the first flush of a key prefix is seen to have lost it:
the DB records each shard's epoch token before the first delta is pushed."""

from __future__ import annotations

import json
import logging

import pytest

import counters
from counters import api
from counters.models import BufferEpoch, BufferLayout
from counters.status import gather
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth
from tests.procs import project_env, run_manage
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]


@pytest.fixture
def four_shards(settings):
    settings.COUNTERS_SHARDS = 4
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # rebuilds confirm drift 0.6 s apart


def restart_empty(server: RedisServer) -> None:
    server.kill()
    server.start()


def assert_exact_after_flush(users) -> None:
    """truth == get_value == stored, after a flush applies what the rebuild repaired."""
    assert counters.flush().rebuild_needed_since is None
    for user in users:
        value = UnreadCounter.objects.get_count(user)
        assert (user.pk, value, stored(user)) == (user.pk, truth(user), truth(user))


def notify(users, times: int) -> None:
    for user in users:
        for _ in range(times):
            Notification.objects.create(recipient=user, verb="v")


def test_a_restart_before_the_first_flush_is_a_loss_until_rebuilt(
    four_shards, own_redis, settings, make_user, caplog
):
    settings.COUNTERS_AUTO_REBUILD = False
    users = [make_user() for _ in range(6)]
    notify(users, 3)  # never flushed
    prefix = api.get_buffer().prefix
    assert BufferEpoch.objects.filter(prefix=prefix).count() == 4  # recorded before the push
    assert BufferLayout.objects.filter(prefix=prefix, shards=4, cluster=False).exists()
    assert gather(api.get_buffer())["epoch"]["state"] == "ok"

    restart_empty(own_redis)
    notify(users, 1)  # pushed into the empty Redis
    status = gather(api.get_buffer())["epoch"]
    assert (status["state"], status["shards_lost_since_last_flush"]) == ("lost", [0, 1, 2, 3])
    with caplog.at_level(logging.ERROR, logger="counters.epoch"):
        result = counters.flush()
    assert sorted(result.lost_shards) == [0, 1, 2, 3]
    assert result.rebuild_needed_since is not None
    assert len([r for r in caplog.records if r.name == "counters.epoch"]) == 4
    assert [(stored(u), truth(u)) for u in users] == [(1, 4)] * 6  # the loss is real

    env = project_env(COUNTERS_SHARDS="4", COUNTERS_AUTO_REBUILD="0")
    code, out, err = run_manage("counters_flush", "--json", env=env)
    assert code == 4, err
    assert json.loads(out)["rebuild_needed_since"] == result.rebuild_needed_since
    assert gather(api.get_buffer())["epoch"]["state"] == "rebuild_needed"

    api.rebuild_all()
    assert counters.flush().rebuild_needed_since is None
    assert gather(api.get_buffer())["epoch"]["state"] == "repaired"
    assert_exact_after_flush(users)
    assert sum(truth(u) for u in users) == 24


def test_the_automatic_rebuild_repairs_a_loss_before_the_first_flush(
    four_shards, own_redis, make_user
):
    users = [make_user() for _ in range(3)]
    notify(users, 2)
    restart_empty(own_redis)
    result = counters.flush()
    assert sorted(result.lost_shards) == [0, 1, 2, 3]
    assert result.rebuild_needed_since is None  # the automatic rebuild completed
    assert_exact_after_flush(users)
    assert [truth(u) for u in users] == [2, 2, 2]


def test_a_prefix_only_read_records_nothing(four_shards, own_redis, make_user):
    """Only a push records the layout: reads and an empty flush of a new prefix do not
    leave layouts behind for every prefix a process merely looked at."""
    user = make_user()
    assert UnreadCounter.objects.get_count(user) == 0
    assert not BufferLayout.objects.exists()
