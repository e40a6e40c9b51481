"""Operator commands on a bad day: Redis down, the database down, a shard failing.

Each prints one readable line on failure (the traceback only in the DEBUG
log), JSON when asked for it, and a documented exit status. With ``--json``
the output is JSON always (an ``error`` field and a non-zero exit); a Redis
error reply is named as such, and ``check --deploy`` flags eviction.
"""

from __future__ import annotations

import io
import json
import logging
from unittest import mock

import pytest
from django.core.management import CommandError, call_command
from django.core.management.base import SystemCheckError
from django.db import OperationalError
from django.utils import timezone
from redis.exceptions import ResponseError

from counters.checks import check_redis_eviction, check_redis_persistence
from counters.client import buffer_prefix, get_buffer, get_client
from counters.flushing import shard as flusher
from counters.management.commands.counters_flush import Command as FlushCommand
from counters.models import BufferEpoch, FlushBatch
from notifications.management.commands.notification_update_counter import (
    Command as UpdateCounterCommand,
)
from notifications.models import Notification
from tests.helpers import stored, truth
from tests.procs import project_env, run_manage

pytestmark = [pytest.mark.django_db(transaction=True)]


REDIS_DOWN = "redis://127.0.0.1:1/0"
DB_DOWN = "postgres://postgres@127.0.0.1:1/nowhere"
FLUSH_COMMANDS = [
    pytest.param("counters_flush", id="counters_flush"),
    pytest.param("notification_update_counter", id="notification_update_counter"),
]


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def redis_down(**extra: str) -> dict[str, str]:
    return project_env(COUNTERS_REDIS_URL=REDIS_DOWN, COUNTERS_SOCKET_TIMEOUT="0.5", **extra)


def test_notification_update_counter_is_counters_flush():
    assert issubclass(UpdateCounterCommand, FlushCommand)


@pytest.mark.parametrize("command", FLUSH_COMMANDS)
def test_flush_with_redis_down_prints_json_and_fails(command):
    code, out, err = run_manage(command, "--json", env=redis_down())
    assert code == 1
    data = json.loads(out)
    assert data["redis"] == "unreachable"
    assert data["error"].startswith(f"Redis unreachable at {REDIS_DOWN}")
    assert one_line(err) == f"CommandError: {data['error']}"


@pytest.mark.parametrize("command", FLUSH_COMMANDS)
def test_flush_with_the_database_down_prints_json_and_fails(command):
    code, out, err = run_manage(command, "--json", env=project_env(DATABASE_URL=DB_DOWN))
    assert code == 1
    data = json.loads(out)
    assert data["error"].startswith("database error: ")
    assert "redis" not in data
    assert one_line(err) == f"CommandError: {data['error']}"


@pytest.mark.redis
def test_the_traceback_of_a_failure_is_in_the_debug_log_only():
    code, _, err = run_manage("counters_flush", env=redis_down(COUNTERS_LOG_LEVEL="DEBUG"))
    assert code == 1
    assert "Traceback" in err
    assert "DEBUG counters.management.commands._failures counters_flush failed" in err
    assert err.strip().splitlines()[-1].startswith("CommandError: Redis unreachable")


@pytest.mark.redis
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_status_with_redis_down_shows_the_database_side(settings, make_user):
    alice = make_user()
    settings.COUNTERS_REDIS_URL = REDIS_DOWN
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    Notification.objects.create(recipient=alice, verb="written while Redis is down")
    assert stored(alice) == truth(alice) == 1  # the write fell back to the DB
    since = timezone.now()
    BufferEpoch.objects.create(
        prefix=buffer_prefix(), shard=0, token="t", losses=1, rebuild_needed_since=since
    )
    code, out, err = run_manage("counters_status", env=redis_down())
    assert code == 2
    assert one_line(err).startswith(f"Redis unreachable at {REDIS_DOWN}")
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"prefix {buffer_prefix()!r}: REDIS DOWN (Redis unreachable")
    assert "epoch: rebuild_needed (losses 1, last -)" in lines
    assert any(line.startswith(f"REBUILD NEEDED since {since.isoformat()}") for line in lines)
    assert any(" fallback DB writes 1 " in line for line in lines)
    assert "unsettled direct writes: 0" in lines  # refused connections never arrive later

    code, out, _ = run_manage("counters_status", "--json", env=redis_down())
    assert code == 2
    data = json.loads(out)
    assert data["redis"]["reachable"] is False
    assert (data["ledger"]["fallback_writes"], data["ledger"]["unsettled_fallbacks"]) == (1, 0)
    assert data["epoch"]["rebuild_needed_since"] == since.isoformat()
    assert "shards" not in data


@pytest.mark.parametrize("args", [pytest.param([], id="text"), pytest.param(["--json"], id="json")])
def test_status_with_the_database_down_fails_with_one_line(args):
    code, _, err = run_manage("counters_status", *args, env=project_env(DATABASE_URL=DB_DOWN))
    assert code == 1
    assert one_line(err).startswith("CommandError: database error: ")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(redis_down, "CommandError: Redis unreachable", id="redis"),
        pytest.param(
            lambda: project_env(DATABASE_URL=DB_DOWN), "CommandError: database error", id="database"
        ),
    ],
)
@pytest.mark.parametrize(
    "args", [pytest.param([], id="full"), pytest.param(["--dry-run"], id="dry-run")]
)
@pytest.mark.redis
def test_rebuild_fails_with_one_line(env, expected, args, make_user):
    Notification.objects.create(recipient=make_user(), verb="something to check")
    code, _, err = run_manage("notification_rebuild_counters", *args, env=env())
    assert code == 1
    assert one_line(err).startswith(expected)


@pytest.mark.redis
@pytest.mark.parametrize(
    ("command", "target"),
    [
        pytest.param(
            "counters_flush",
            "counters.management.commands.counters_flush.flush_databases",
            id="counters_flush",
        ),
        pytest.param(
            "notification_rebuild_counters",
            "counters.management.commands.counters_rebuild.rebuild_all",
            id="rebuild_counters",
        ),
        pytest.param(
            "counters_status",
            "counters.management.commands.counters_status.gather",
            id="counters_status",
        ),
    ],
)
def test_an_unexpected_error_in_a_command_is_one_line(command, target, caplog):
    with (
        caplog.at_level(logging.DEBUG, logger="counters"),
        mock.patch(target, side_effect=KeyError("surprise")),
        pytest.raises(CommandError, match=r"^KeyError: 'surprise'$"),
    ):
        call_command(command, stdout=io.StringIO(), stderr=io.StringIO())
    [record] = [r for r in caplog.records if r.name.startswith("counters.management")]
    assert record.exc_info is not None  # the traceback, for the DEBUG log


@pytest.mark.redis
def test_a_failed_shard_shows_in_the_flush_json_and_in_the_status(settings, make_user):
    settings.COUNTERS_SHARDS = 2
    buffer = get_buffer()
    users = [make_user() for _ in range(6)]
    broken = buffer.shard_of(f"unread:{users[0].pk}")
    while all(buffer.shard_of(f"unread:{u.pk}") == broken for u in users):
        users[-1] = make_user()  # some user in the healthy shard too, whatever the pks
    for user in users:
        Notification.objects.create(recipient=user, verb="v")
    real = flusher.apply_batch

    def locked(batch, using, result):
        if batch.shard == broken:
            raise OperationalError("canceling statement due to lock timeout")
        return real(batch, using, result)

    out = io.StringIO()
    with (
        mock.patch.object(flusher, "apply_batch", locked),
        pytest.raises(CommandError, match="flush failed in 1 shard"),
    ):
        call_command("counters_flush", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["failed_shards"] == {str(broken): "canceling statement due to lock timeout"}
    assert data["error"].startswith(f"flush failed in 1 shard(s); shard {broken}: ")
    healthy = [u for u in users if buffer.shard_of(f"unread:{u.pk}") != broken]
    assert data["keys"] == len(healthy) > 0

    status = io.StringIO()
    call_command("counters_status", stdout=status)
    assert (
        f"FAILED shard {broken} in the last flush: canceling statement due to lock timeout"
        in status.getvalue().splitlines()
    )
    status = io.StringIO()
    call_command("counters_status", "--json", stdout=status)
    assert json.loads(status.getvalue())["last_flush"]["failed_shards"] == {
        str(broken): "canceling statement due to lock timeout"
    }
    call_command("counters_flush", stdout=io.StringIO())
    assert [stored(u) for u in users] == [truth(u) for u in users] == [1] * 6
    assert FlushBatch.objects.count() == 2


# -- JSON with --json, Redis error replies, check --deploy on eviction -----------------


def db_down() -> dict[str, str]:
    return project_env(DATABASE_URL=DB_DOWN)


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


@pytest.mark.redis
@pytest.mark.serial
@pytest.mark.parametrize("command", ["counters_rebuild", "notification_rebuild_counters"])
def test_rebuild_dry_run_json_with_redis_down_prints_the_error(command, make_user):
    Notification.objects.create(recipient=make_user(), verb="something to check")
    code, out, err = run_manage(command, "--dry-run", "--json", env=redis_down())
    assert code == 1
    data = json.loads(out)
    assert data["redis"] == "unreachable"
    assert data["error"].startswith(f"Redis unreachable at {REDIS_DOWN}: ")
    assert last_line(err) == f"CommandError: {data['error']}"


@pytest.mark.redis
@pytest.mark.serial
@pytest.mark.parametrize("args", [["--dry-run", "--json"], ["--json"]], ids=["dry-run", "full"])
def test_rebuild_json_with_the_database_down_prints_the_error(args):
    code, out, err = run_manage("counters_rebuild", *args, env=db_down())
    assert code == 1
    data = json.loads(out)
    assert data["error"].startswith("database error: ")
    assert "redis" not in data
    assert last_line(err) == f"CommandError: {data['error']}"


@pytest.mark.redis
@pytest.mark.serial
def test_status_json_with_the_database_down_prints_the_error():
    code, out, err = run_manage("counters_status", "--json", env=db_down())
    assert code == 1
    data = json.loads(out)
    assert data["error"].startswith("database error: ")
    assert data["database"] == {"alias": "default", "reachable": False}
    assert data["prefix"] == buffer_prefix()
    assert last_line(err) == f"CommandError: {data['error']}"


@pytest.fixture
def wrong_type(settings, make_user):
    """Shard 0's pending set is a string (an operator's SET, another app's key)."""
    settings.COUNTERS_SHARDS = 1
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    buffer = get_buffer()
    key = buffer.key(0, "pending")
    saved = buffer.client.dump(key)
    buffer.client.delete(key)
    buffer.client.set(key, "not a sorted set")
    yield alice
    buffer.client.delete(key)
    buffer.client.restore(key, 0, saved)


@pytest.mark.redis
@pytest.mark.serial
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_wrongtype_reply_is_named_as_an_error_reply_by_the_status(wrong_type):
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as info:
        call_command("counters_status", stdout=out, stderr=err)
    assert info.value.code == 2
    assert "unreachable" not in err.getvalue().lower()
    assert "answered with an error reply: " in err.getvalue()
    assert "WRONGTYPE" in err.getvalue()
    assert out.getvalue().startswith(f"prefix {buffer_prefix()!r}: REDIS ERROR REPLY (")


@pytest.mark.redis
@pytest.mark.serial
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_wrongtype_reply_is_named_as_an_error_reply_by_the_flush(wrong_type):
    out = io.StringIO()
    with pytest.raises(CommandError) as info:
        call_command("counters_flush", "--json", stdout=out)
    data = json.loads(out.getvalue())  # a shard's failure: the others are still flushed
    assert data["error"] == (
        "flush failed in 1 shard(s); shard 0: "
        "WRONGTYPE Operation against a key holding the wrong kind of value"
    )
    assert data["failed_shards"] == {"0": data["error"].partition("shard 0: ")[2]}
    assert "redis" not in data
    assert str(info.value) == data["error"]


@pytest.mark.redis
@pytest.mark.serial
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_after_the_wrong_key_is_gone_the_delta_is_flushed_once(wrong_type):
    alice = wrong_type
    with pytest.raises(CommandError):
        call_command("counters_flush", stdout=io.StringIO())
    buffer = get_buffer()
    buffer.client.delete(buffer.key(0, "pending"))
    buffer.client.zadd(buffer.key(0, "pending"), {f"unread:{alice.pk}": 1})
    call_command("counters_flush", stdout=io.StringIO())
    assert stored(alice) == truth(alice) == 1


@pytest.mark.redis
@pytest.mark.serial
@pytest.mark.parametrize(
    ("policy", "ids"),
    [
        ("allkeys-lru", ["counters.E071"]),
        ("allkeys-lfu", ["counters.E071"]),
        ("allkeys-random", ["counters.E071"]),
        ("volatile-lru", ["counters.W018"]),
        ("volatile-ttl", ["counters.W018"]),
        ("noeviction", []),
    ],
)
def test_check_deploy_flags_evicting_policies(own_redis, policy, ids):
    client = get_client()
    client.config_set("maxmemory-policy", policy)
    messages = check_redis_eviction()
    assert [m.id for m in messages] == ids
    if ids:
        assert policy in messages[0].msg
        assert "noeviction" in messages[0].hint


@pytest.mark.redis
@pytest.mark.serial
def test_check_deploy_fails_on_allkeys_lru(own_redis):
    get_client().config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(SystemCheckError, match=r"counters\.E071"):
        call_command("check", "--deploy", stdout=io.StringIO(), stderr=io.StringIO())


@pytest.mark.redis
@pytest.mark.serial
def test_a_policy_that_cannot_be_read_is_w019():
    """Managed Redis services often disable CONFIG: the check says it could not look."""
    client = get_client()
    refused = ResponseError("unknown command 'CONFIG'")
    with mock.patch.object(type(client), "config_get", side_effect=refused):
        [message] = check_redis_eviction()
    assert message.id == "counters.W019"
    assert "unknown command 'CONFIG'" in message.msg


@pytest.mark.redis
@pytest.mark.serial
def test_unreachable_redis_is_left_to_w001(settings):
    settings.COUNTERS_REDIS_URL = REDIS_DOWN
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    assert check_redis_eviction() == []


@pytest.mark.redis
@pytest.mark.serial
@pytest.mark.parametrize(
    ("config", "ids"),
    [
        pytest.param({}, ["counters.W020"], id="nothing-on-disk"),
        pytest.param({"save": "3600 1"}, [], id="snapshots"),
    ],
)
def test_check_deploy_warns_about_a_redis_that_keeps_nothing_on_disk(own_redis, config, ids):
    client = get_client()
    for name, value in config.items():
        client.config_set(name, value)
    messages = check_redis_persistence()
    assert [m.id for m in messages] == ids
    if ids:
        assert 'keeps nothing on disk (appendonly no, save "")' in messages[0].msg
        assert "COUNTERS_DURABLE" in messages[0].hint and "audit" in messages[0].hint


@pytest.mark.redis
def test_no_persistence_warning_when_config_is_refused():
    client = get_client()
    refused = ResponseError("unknown command 'CONFIG'")
    with mock.patch.object(type(client), "config_get", side_effect=refused):
        assert check_redis_persistence() == []
