"""Redis data loss stays loud (flush exit code, status, Celery log) until a full rebuild.

A Redis that loses its data before the first flush of a key prefix is seen to
have lost it too: the DB records each shard's epoch token before the first
delta is pushed.
"""

from __future__ import annotations

import json
import logging

import pytest

import counters
from counters import tasks
from counters.client import get_buffer
from counters.models import BufferEpoch, BufferLayout
from counters.ops.status import gather
from counters.verify.rebuild import rebuild_all, rebuild_lease
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth
from tests.procs import project_env, run_manage
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.django_db(transaction=True)]


REBUILD_NEEDED = 4


@pytest.fixture
def manual(settings):
    """Two shards, quick rebuilds, and no automatic rebuild: the operator must act."""
    settings.COUNTERS_SHARDS = 2
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # rebuilds confirm drift 0.6 s apart
    settings.COUNTERS_AUTO_REBUILD = False


def env() -> dict[str, str]:
    """The `manual` settings for the commands' processes (a rebuild there confirms drift
    0.6 s apart too, not the default timeout's 4.2 s)."""
    return project_env(
        COUNTERS_SHARDS="2", COUNTERS_AUTO_REBUILD="0", COUNTERS_SOCKET_TIMEOUT="0.2"
    )


def lose_redis_data(own_redis, *users) -> None:
    """Counts flushed, one more unread each still buffered, then Redis loses everything."""
    for user in users:
        Notification.objects.create(recipient=user, verb="flushed")
    counters.flush()
    for user in users:
        Notification.objects.create(recipient=user, verb="lost with Redis")
    counters.get_client().flushall()


def status_json() -> dict:
    code, out, err = run_manage("counters_status", "--json", env=env())
    assert code == 0, err
    return json.loads(out)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_flushall_fails_the_flush_command_and_shows_in_status_until_a_full_rebuild(
    manual, own_redis, make_user
):
    alice, bob = make_user(), make_user()
    lose_redis_data(own_redis, alice, bob)
    epoch = status_json()["epoch"]
    assert (epoch["state"], epoch["rebuild_needed"], epoch["rebuild_needed_since"]) == (
        "lost",
        True,
        None,
    )

    code, out, err = run_manage("notification_update_counter", env=env())
    assert code == REBUILD_NEEDED
    assert "REDIS LOST DATA in 2 shards" in out.strip()
    since = BufferEpoch.objects.order_by("rebuild_needed_since")[0].rebuild_needed_since
    line = (
        f"counts are wrong since {since.isoformat()} (Redis lost buffered deltas) until a full "
        "rebuild completes: run `manage.py counters_rebuild`"
    )
    assert err.strip().splitlines()[-1] == line  # after the ERROR logged per lost shard

    # every later flush says so too, though it finds no new loss
    code, out, err = run_manage("notification_update_counter", "--json", env=env())
    assert code == REBUILD_NEEDED, err
    assert err.strip().splitlines() == [line]
    result = json.loads(out)
    assert (result["lost_shards"], result["rebuild_needed_since"]) == ([], since.isoformat())
    epoch = status_json()["epoch"]
    assert (epoch["state"], epoch["losses"], epoch["rebuild_needed_since"]) == (
        "rebuild_needed",
        2,
        since.isoformat(),
    )
    code, out, err = run_manage("counters_status", env=env())
    assert code == 0, err
    assert f"REBUILD NEEDED since {since.isoformat()}" in out
    assert "`manage.py counters_rebuild`" in out
    assert [UnreadCounter.objects.get_count(u) for u in (alice, bob)] == [1, 1]
    assert [truth(u) for u in (alice, bob)] == [2, 2]

    # a rebuild of some users only is not the full rebuild
    code, _, err = run_manage("notification_rebuild_counters", "--user", str(alice.pk), env=env())
    assert code == 0, err
    assert run_manage("notification_update_counter", env=env())[0] == REBUILD_NEEDED

    code, out, err = run_manage("notification_rebuild_counters", env=env())
    assert code == 0, err
    assert "checked 2 unread counters, repaired 1 wrong" in out
    assert f"the Redis data loss seen since {since.isoformat()} is repaired" in out
    code, out, err = run_manage("notification_update_counter", env=env())
    assert code == 0, err
    assert "REBUILD NEEDED" not in out
    epoch = status_json()["epoch"]
    assert (epoch["state"], epoch["rebuild_needed"], epoch["losses"]) == ("repaired", False, 2)
    code, out, _ = run_manage("counters_status", env=env())
    assert "REBUILD NEEDED" not in out
    assert_exact(alice, bob)
    assert [stored(alice), stored(bob)] == [2, 2]


def test_a_rebuild_that_started_before_the_loss_does_not_clear_it(manual, own_redis, make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    counters.flush()
    losses = []

    def lose_data_mid_rebuild(done: int, total: int) -> None:
        lose_redis_data(own_redis, alice)
        losses.append(counters.flush().lost_shards)

    rebuild_all(progress=lose_data_mid_rebuild)
    assert [sorted(lost) for lost in losses] == [[0, 1]]
    assert counters.flush().rebuild_needed_since is not None
    rebuild_all()
    assert counters.flush().rebuild_needed_since is None
    assert_exact(alice)


def test_the_celery_task_logs_an_error_at_every_run_until_rebuilt(
    manual, own_redis, make_user, caplog
):
    alice = make_user()
    lose_redis_data(own_redis, alice)
    with caplog.at_level(logging.ERROR, logger="counters.tasks"):
        tasks.flush_counters()
        tasks.flush_counters()
    errors = [r for r in caplog.records if r.name == "counters.tasks"]
    assert [r.levelno for r in errors] == [logging.ERROR, logging.ERROR]
    assert all("counters_rebuild" in r.getMessage() for r in errors)
    rebuild_all()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="counters.tasks"):
        tasks.flush_counters()
    assert [r for r in caplog.records if r.name == "counters.tasks"] == []


def test_one_full_rebuild_at_a_time(manual, own_redis, make_user):
    from counters.base.exceptions import RebuildRunning

    alice = make_user()
    lose_redis_data(own_redis, alice)
    buffer = get_buffer()
    with rebuild_lease(buffer) as lease:
        assert lease.held
        with pytest.raises(RebuildRunning) as info:
            rebuild_all()
        assert info.value.lease_key == f"{buffer.prefix}:rebuild"
        code, _, err = run_manage("notification_rebuild_counters", env=env())
        assert code == 1
        assert err.strip().splitlines() == [
            "CommandError: another rebuild or audit is running "
            f"(it holds {buffer.prefix}:rebuild); try again later"
        ]
    assert counters.flush().rebuild_needed_since is not None
    rebuild_all()
    assert counters.flush().rebuild_needed_since is None
    assert_exact(alice)


# -- a loss before the first flush of a key prefix -------------------------------------


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


@pytest.mark.redis
@pytest.mark.serial
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_restart_before_the_first_flush_is_a_loss_until_rebuilt(
    four_shards, own_redis, settings, make_user, caplog
):
    settings.COUNTERS_AUTO_REBUILD = False
    users = [make_user() for _ in range(6)]
    notify(users, 3)  # never flushed
    prefix = get_buffer().prefix
    assert BufferEpoch.objects.filter(prefix=prefix).count() == 4  # recorded before the push
    assert BufferLayout.objects.filter(prefix=prefix, shards=4, cluster=False).exists()
    assert gather(get_buffer())["epoch"]["state"] == "ok"

    restart_empty(own_redis)
    notify(users, 1)  # pushed into the empty Redis
    status = gather(get_buffer())["epoch"]
    assert (status["state"], status["shards_lost_since_last_flush"]) == ("lost", [0, 1, 2, 3])
    with caplog.at_level(logging.ERROR, logger="counters.flushing.epoch"):
        result = counters.flush()
    assert sorted(result.lost_shards) == [0, 1, 2, 3]
    assert result.rebuild_needed_since is not None
    [logged] = [r.getMessage() for r in caplog.records if r.name == "counters.flushing.epoch"]
    assert logged.startswith("Redis lost the buffer of shards 0, 1, 2, 3 under prefix ")
    assert [(stored(u), truth(u)) for u in users] == [(1, 4)] * 6  # the loss is real

    env = project_env(COUNTERS_SHARDS="4", COUNTERS_AUTO_REBUILD="0")
    code, out, err = run_manage("counters_flush", "--json", env=env)
    assert code == 4, err
    assert json.loads(out)["rebuild_needed_since"] == result.rebuild_needed_since
    assert gather(get_buffer())["epoch"]["state"] == "rebuild_needed"

    rebuild_all()
    assert counters.flush().rebuild_needed_since is None
    assert gather(get_buffer())["epoch"]["state"] == "repaired"
    assert_exact_after_flush(users)
    assert sum(truth(u) for u in users) == 24


@pytest.mark.redis
@pytest.mark.serial
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


@pytest.mark.redis
@pytest.mark.serial
def test_a_prefix_only_read_records_nothing(four_shards, own_redis, make_user):
    """Only a push records the layout: reads and an empty flush of a new prefix do not
    leave layouts behind for every prefix a process merely looked at."""
    user = make_user()
    assert UnreadCounter.objects.get_count(user) == 0
    assert not BufferLayout.objects.exists()
