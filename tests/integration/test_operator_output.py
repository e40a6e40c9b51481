"""Operator output on a bad day: JSON always with ``--json`` (an ``error`` field and a
non-zero exit), a Redis error reply named as such, and ``check --deploy`` on eviction."""

from __future__ import annotations

import io
import json
from unittest import mock

import pytest
from django.core.management import CommandError, call_command
from django.core.management.base import SystemCheckError
from redis.exceptions import ResponseError

from counters import api
from counters.checks import check_redis_eviction
from notifications.models import Notification
from tests.helpers import stored, truth
from tests.procs import project_env, run_manage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]

REDIS_DOWN = "redis://127.0.0.1:1/0"
DB_DOWN = "postgres://postgres@127.0.0.1:1/nowhere"


def redis_down() -> dict[str, str]:
    return project_env(COUNTERS_REDIS_URL=REDIS_DOWN, COUNTERS_SOCKET_TIMEOUT="0.5")


def db_down() -> dict[str, str]:
    return project_env(DATABASE_URL=DB_DOWN)


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["counters_rebuild", "notification_rebuild_counters"])
def test_rebuild_dry_run_json_with_redis_down_prints_the_error(command, make_user):
    Notification.objects.create(recipient=make_user(), verb="something to check")
    code, out, err = run_manage(command, "--dry-run", "--json", env=redis_down())
    assert code == 1
    data = json.loads(out)
    assert data["redis"] == "unreachable"
    assert data["error"].startswith(f"Redis unreachable at {REDIS_DOWN}: ")
    assert last_line(err) == f"CommandError: {data['error']}"


@pytest.mark.parametrize("args", [["--dry-run", "--json"], ["--json"]], ids=["dry-run", "full"])
def test_rebuild_json_with_the_database_down_prints_the_error(args):
    code, out, err = run_manage("counters_rebuild", *args, env=db_down())
    assert code == 1
    data = json.loads(out)
    assert data["error"].startswith("database error: ")
    assert "redis" not in data
    assert last_line(err) == f"CommandError: {data['error']}"


def test_status_json_with_the_database_down_prints_the_error():
    code, out, err = run_manage("counters_status", "--json", env=db_down())
    assert code == 1
    data = json.loads(out)
    assert data["error"].startswith("database error: ")
    assert data["database"] == {"alias": "default", "reachable": False}
    assert data["prefix"] == api.buffer_prefix()
    assert last_line(err) == f"CommandError: {data['error']}"


@pytest.fixture
def wrong_type(settings, make_user):
    """Shard 0's pending set is a string (an operator's SET, another app's key)."""
    settings.COUNTERS_SHARDS = 1
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    buffer = api.get_buffer()
    key = buffer.key(0, "pending")
    saved = buffer.client.dump(key)
    buffer.client.delete(key)
    buffer.client.set(key, "not a sorted set")
    yield alice
    buffer.client.delete(key)
    buffer.client.restore(key, 0, saved)


def test_a_wrongtype_reply_is_named_as_an_error_reply_by_the_status(wrong_type):
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as info:
        call_command("counters_status", stdout=out, stderr=err)
    assert info.value.code == 2
    assert "unreachable" not in err.getvalue().lower()
    assert "answered with an error reply: " in err.getvalue()
    assert "WRONGTYPE" in err.getvalue()
    assert out.getvalue().startswith(f"prefix {api.buffer_prefix()!r}: REDIS ERROR REPLY (")


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


def test_after_the_wrong_key_is_gone_the_delta_is_flushed_once(wrong_type):
    alice = wrong_type
    with pytest.raises(CommandError):
        call_command("counters_flush", stdout=io.StringIO())
    buffer = api.get_buffer()
    buffer.client.delete(buffer.key(0, "pending"))
    buffer.client.zadd(buffer.key(0, "pending"), {f"unread:{alice.pk}": 1})
    call_command("counters_flush", stdout=io.StringIO())
    assert stored(alice) == truth(alice) == 1


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
    client = api.get_client()
    client.config_set("maxmemory-policy", policy)
    messages = check_redis_eviction()
    assert [m.id for m in messages] == ids
    if ids:
        assert policy in messages[0].msg
        assert "noeviction" in messages[0].hint


def test_check_deploy_fails_on_allkeys_lru(own_redis):
    api.get_client().config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(SystemCheckError, match=r"counters\.E071"):
        call_command("check", "--deploy", stdout=io.StringIO(), stderr=io.StringIO())


def test_a_policy_that_cannot_be_read_is_w019():
    """Managed Redis services often disable CONFIG: the check says it could not look."""
    client = api.get_client()
    refused = ResponseError("unknown command 'CONFIG'")
    with mock.patch.object(type(client), "config_get", side_effect=refused):
        [message] = check_redis_eviction()
    assert message.id == "counters.W019"
    assert "unknown command 'CONFIG'" in message.msg


def test_unreachable_redis_is_left_to_w001(settings):
    settings.COUNTERS_REDIS_URL = REDIS_DOWN
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    assert check_redis_eviction() == []
