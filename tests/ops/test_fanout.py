"""Parallel flush: parts of disjoint shards, the record of a run, and the work done once per run.

First the bookkeeping on fakeredis: the shard sets of the parts and the
record each part adds to its run. Then the parallel flush in one process:
with Celery's ``task_always_eager`` the parts run inline, while the beat task
dispatches them: after it settled the direct writes and before it repairs and
rebuilds (with real workers they run beside that; tests/e2e starts them).
Where each piece of work of a run happened is read back from the run's
record: the dispatcher's result and each part's are kept apart there.
"""

from __future__ import annotations

import json
import logging
from io import StringIO
from types import SimpleNamespace
from unittest import mock

import fakeredis
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import OperationalError

import counters
from config.celery import app
from counters import tasks
from counters.base.exceptions import BufferUnavailable, FlushFailed
from counters.base.registry import get_spec
from counters.base.utils import to_str
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.flushing import shard as flusher
from counters.flushing.lanes import chosen_shards, flush_buffer
from counters.flushing.result import FlushResult
from counters.models import BufferEpoch, FlushBatch
from counters.ops import fanout
from counters.ops.fanout import last_run, partition, record_part, run_key
from counters.ops.status import gather, last_flush
from counters.write import negatives as repair
from counters.write.delivery import write_direct
from notifications.apps import UNREAD_COUNTER
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth
from tests.procs import project_env, run_manage

# -- the parts and the record of a run (fakeredis) -------------------------------------


@pytest.mark.parametrize(
    ("shards", "parts"),
    [(16, 1), (16, 2), (16, 3), (16, 4), (16, 16), (16, 40), (1, 4), (7, 2)],
    ids=lambda v: str(v),
)
def test_parts_are_disjoint_non_empty_and_cover_every_shard(shards, parts):
    sets = partition(shards, parts)
    assert len(sets) == min(shards, parts)
    assert all(sets)
    flat = [s for part in sets for s in part]
    assert sorted(flat) == list(range(shards))  # each shard once
    assert max(map(len, sets)) - min(map(len, sets)) <= 1  # balanced


def test_part_i_takes_every_nth_shard():
    assert partition(8, 3) == [[0, 3, 6], [1, 4, 7], [2, 5]]


@pytest.mark.parametrize(("shards", "parts"), [(0, 2), (16, 0), (16, -1)])
def test_partition_refuses_nothing_to_split(shards, parts):
    with pytest.raises(ValueError, match="need at least 1 shard and 1 part"):
        partition(shards, parts)


@pytest.mark.parametrize(
    ("shards", "message"),
    [
        pytest.param([16], r"shards \[16\] are not shards of this buffer \(0 to 15\)", id="high"),
        pytest.param([-1, 3], r"shards \[-1\]", id="negative"),
        pytest.param(["1"], r"shards \['1'\]", id="string"),
        pytest.param([True], r"shards \[True\]", id="bool"),
        pytest.param([], "no shards to flush", id="empty"),
    ],
)
def test_the_engine_refuses_shards_the_buffer_does_not_have(client, shards, message):
    with pytest.raises(ValueError, match=message):
        chosen_shards(Buffer(client, "p", 16), shards)


def test_the_engine_takes_shards_sorted_once(client):
    buffer = Buffer(client, "p", 16)
    assert chosen_shards(buffer, [5, 1, 5, 0]) == [0, 1, 5]
    assert chosen_shards(buffer, None) == list(range(16))


def start(buffer: Buffer, run: str, parts: int, at: float) -> None:
    buffer.client.delete(run_key(buffer))
    buffer.client.hset(run_key(buffer), mapping={"id": run, "parts": parts, "at": at})


@pytest.fixture
def client() -> fakeredis.FakeRedis:
    """A fakeredis server of this test alone (in place of pytest-django's test client)."""
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


@pytest.fixture
def part(monkeypatch):
    """``part(buffer, run, index, parts, at, **counts)``: record a part that ended at ``at``."""

    def record(buffer: Buffer, run: str, index: int, parts: int, at: float, **counts) -> None:
        monkeypatch.setattr(fanout, "time", SimpleNamespace(time=lambda: at))
        record_part(buffer, run, index, parts, [index], FlushResult(**counts))

    return record


@pytest.fixture
def buffer(client) -> Buffer:
    return Buffer(client, "p", 16)


def test_a_run_adds_up_the_parts_that_reported(buffer, part):
    start(buffer, "r1", 3, at=100.0)
    part(buffer, "r1", 0, 3, at=100.5, batches=2, keys=30, busy_shards=[3])
    part(buffer, "r1", 2, 3, at=101.25, batches=1, keys=5, failed_shards={"6": "boom"})
    run = last_run(buffer)
    assert run is not None
    assert (run["batches"], run["keys"], run["busy_shards"], run["failed_shards"]) == (
        3,
        35,
        [3],
        {"6": "boom"},
    )
    assert run["seconds"] == 1.25  # dispatch to the last report: the parts ran side by side
    assert run["at"] == 101.25
    assert run["parallel"] == {
        "run": "r1",
        "parts": 3,
        "reported": 2,
        "shards": {"0": [0], "2": [2]},
    }


def test_a_late_part_of_an_older_run_is_not_counted(buffer, part):
    start(buffer, "r2", 2, at=200.0)
    part(buffer, "r1", 0, 2, at=201.0, keys=99)  # run r1 was replaced by r2
    part(buffer, "r2", 1, 2, at=200.5, keys=1)
    run = last_run(buffer)
    assert run is not None
    assert (run["keys"], run["parallel"]["reported"]) == (1, 1)


def test_the_dispatchers_own_work_is_part_of_the_run(buffer):
    start(buffer, "r1", 2, at=100.0)
    dispatch = FlushResult(compensated=1, repaired=2)
    buffer.client.hset(
        run_key(buffer), "dispatch:r1", json.dumps({"at": 100.1, "result": dispatch.as_dict()})
    )
    run = last_run(buffer)
    assert run is not None
    assert (run["compensated"], run["repaired"], run["parallel"]["reported"]) == (1, 2, 0)


def test_no_run_recorded(buffer):
    assert last_run(buffer) is None
    assert last_flush(buffer) is None


def test_status_shows_the_newest_of_a_whole_flush_and_a_parallel_run(buffer, part):
    whole = {**FlushResult(keys=9).as_dict(), "at": 150.0}
    buffer.client.hset(
        f"{buffer.prefix}:last_flush", mapping={k: json.dumps(v) for k, v in whole.items()}
    )
    start(buffer, "r1", 2, at=100.0)
    part(buffer, "r1", 0, 2, at=120.0, keys=3)
    shown = last_flush(buffer)
    assert shown is not None
    assert (shown["keys"], shown["parallel"]) == (9, None)
    part(buffer, "r1", 1, 2, at=160.0, keys=4)
    shown = last_flush(buffer)
    assert shown is not None
    assert (shown["keys"], shown["parallel"]["reported"]) == (7, 2)
    assert "at" not in shown and shown["age_seconds"] > 0


# -- the parallel flush in one process, on Redis and the database ----------------------


PARTS = 4


@pytest.fixture
def eager(settings):
    """COUNTERS_FLUSH_PARALLELISM = 4, and sent tasks run inline."""
    settings.COUNTERS_FLUSH_PARALLELISM = PARTS
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2  # repairs confirm drift 0.6 s apart
    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = before


def spread(make_user, count: int = 24) -> list:
    users = [make_user() for _ in range(count)]
    for i, user in enumerate(users):
        for j in range(i % 3 + 1):
            note = Notification.objects.create(recipient=user, verb=f"n{j}")
            if j == 1:
                note.mark_read()
    return users


def shard_of(user) -> int:
    return get_buffer().shard_of(get_spec(UNREAD_COUNTER).member(user.pk))


def records() -> tuple[dict, list[dict]]:
    """The dispatcher's result and each part's record ({index, shards, result}) of the run."""
    buffer = get_buffer()
    raw = {to_str(k): to_str(v) for k, v in buffer.client.hgetall(run_key(buffer)).items()}
    run = raw["id"]
    dispatch = json.loads(raw[f"dispatch:{run}"])["result"]
    parts = [json.loads(v) for k, v in raw.items() if k.startswith(f"part:{run}:")]
    return dispatch, sorted(parts, key=lambda p: p["index"])


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_the_engine_flushes_only_the_shards_it_is_given(make_user):
    users = spread(make_user)
    buffer = get_buffer()
    chosen = {shard_of(users[0]), shard_of(users[1])}
    result = flush_buffer(buffer, shards=sorted(chosen))
    inside = [u for u in users if shard_of(u) in chosen]
    outside = [u for u in users if shard_of(u) not in chosen]
    assert outside, "the users must spread over more shards than the two chosen"
    assert result.keys == len(inside)
    assert [stored(u) for u in inside] == [truth(u) for u in inside]
    assert [stored(u) for u in outside] == [0] * len(outside)
    assert {s for s in range(buffer.shards) if buffer.pending_count(s)} == {
        shard_of(u) for u in outside
    }
    rest = [s for s in range(buffer.shards) if s not in chosen]
    assert flush_buffer(buffer, shards=rest).keys == len(outside)
    assert [stored(u) for u in users] == [truth(u) for u in users]


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_the_engine_refuses_a_shard_before_touching_any(make_user):
    spread(make_user, 4)
    buffer = get_buffer()
    with pytest.raises(ValueError, match=r"shards \[16\] are not shards of this buffer"):
        flush_buffer(buffer, shards=[0, 16])
    assert buffer.inflight_ids() == {}
    assert FlushBatch.objects.count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_the_beat_task_sends_one_part_per_shard_set_and_every_count_is_exact(eager, make_user):
    users = spread(make_user)
    tasks.flush_counters()
    buffer = get_buffer()
    assert [stored(u) for u in users] == [truth(u) for u in users]

    _, parts = records()
    assert [p["shards"] for p in parts] == partition(buffer.shards, PARTS)
    assert sum(p["result"]["keys"] for p in parts) == len(users)
    last = gather(buffer)["last_flush"]
    assert last["parallel"]["parts"] == last["parallel"]["reported"] == PARTS
    assert (last["keys"], last["failed_shards"], last["busy_shards"]) == (len(users), {}, [])


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_late_pushes_are_taken_back_once_before_any_part_moves_them(eager, make_user):
    alice = make_user()
    member = get_spec(UNREAD_COUNTER).member(alice.pk)
    Notification.objects.create(recipient=alice, verb="pushed")
    # A direct write whose push timed out, and then reached Redis after all.
    write_direct({member: 1}, "default", push_id="late", unsettled=True)
    get_buffer().push({member: 1}, "late")
    tasks.flush_counters()
    dispatch, parts = records()
    assert dispatch["compensated"] == 1
    assert [p["result"]["compensated"] for p in parts] == [0] * PARTS
    # The late +1 and its take-back cancelled out in Redis before the part moved the shard.
    assert sum(p["result"]["deltas"] for p in parts) == 1
    assert stored(alice) == 1 + 1  # the pushed notification + the direct write, once
    assert FlushBatch.objects.filter(unsettled__isnull=False).count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_keys_read_below_zero_are_repaired_once_per_run_by_the_dispatcher(eager, make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="v")
    counters.flush()
    UnreadCounter.objects.filter(user=alice).update(count=5)  # drift: raw SQL
    repair.queue(get_buffer(), UNREAD_COUNTER, [alice.pk])
    tasks.flush_counters()
    dispatch, parts = records()
    assert dispatch["repaired"] == 1
    assert [p["result"]["repaired"] for p in parts] == [0] * PARTS
    tasks.flush_counters()  # the next run's parts flush the repair's delta
    assert stored(alice) == truth(alice) == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_a_loss_seen_by_the_parts_is_rebuilt_by_the_dispatcher(eager, own_redis, make_user):
    users = spread(make_user, 8)
    counters.flush()
    for user in users:
        Notification.objects.create(recipient=user, verb="lost with Redis")
    counters.get_client().flushall()
    tasks.flush_counters()
    dispatch, parts = records()
    lost = sorted(s for p in parts for s in p["result"]["lost_shards"])
    assert lost == list(range(get_buffer().shards))
    assert all(p["result"]["rebuild_needed_since"] for p in parts)
    assert dispatch["rebuild_needed_since"] is None  # the automatic rebuild completed
    assert not BufferEpoch.objects.filter(rebuild_needed_since__isnull=False).exists()
    tasks.flush_counters()
    assert [stored(u) for u in users] == [truth(u) for u in users]


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_part_with_a_failed_shard_records_it_and_raises(eager, make_user):
    spread(make_user, 8)
    buffer = get_buffer()
    with (
        mock.patch.object(flusher, "apply_deltas", side_effect=OperationalError("boom")),
        pytest.raises(FlushFailed) as failed,
    ):
        fanout.flush_part(using="default", shards=range(buffer.shards), run="r", parts=1)
    assert set(failed.value.errors) == set(buffer.inflight_ids())  # their batches stay in flight
    raw = buffer.client.hget(run_key(buffer), "part:r:0")
    assert json.loads(raw)["result"]["failed_shards"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_redis_down_fails_the_dispatch_with_buffer_unavailable(eager, settings):
    settings.COUNTERS_REDIS_URL = "redis://127.0.0.1:1/0"
    with pytest.raises(BufferUnavailable):
        tasks.flush_counters()


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_parts_and_an_idle_dispatch_log_one_line_each(eager, make_user, caplog):
    spread(make_user, 6)
    with caplog.at_level(logging.DEBUG, logger="counters.tasks"):
        tasks.flush_counters()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "counters.tasks"]
    parts = sorted((line for line in lines if line[1].startswith("part ")), key=lambda x: x[1])
    assert len(parts) == PARTS
    assert parts[0][1].startswith("part 1/4 of run ")
    assert "(database 'default', shards [0, 4, 8, 12]): flushed " in parts[0][1]
    [dispatched] = [line for line in lines if line[1].startswith("run ")]
    assert dispatched[0] == logging.DEBUG  # nothing taken back or repaired
    assert dispatched[1].endswith(
        ": 4 parts sent; 0 late pushes taken back, 0 queued keys repaired"
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_status_shows_the_parallel_run(eager, make_user):
    spread(make_user, 6)
    tasks.flush_counters()
    out = StringIO()
    call_command("counters_status", stdout=out)
    assert "(parallel run " in out.getvalue()
    assert ": 4 of 4 parts reported)" in out.getvalue()


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.parametrize("command", ["counters_flush", "notification_update_counter"])
def test_the_cron_command_flushes_every_shard_itself_whatever_the_parallelism(
    settings, make_user, command
):
    settings.COUNTERS_FLUSH_PARALLELISM = PARTS
    users = spread(make_user, 8)
    code, out, err = run_manage(command, env=project_env(COUNTERS_FLUSH_PARALLELISM=str(PARTS)))
    assert (code, err) == (0, "")
    assert out.startswith("flushed ")
    assert f", {len(users)} keys, " in out
    assert [stored(u) for u in users] == [truth(u) for u in users]
    assert gather(get_buffer())["last_flush"]["parallel"] is None


@pytest.mark.redis
@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_every_database_gets_its_own_parts(eager, settings):
    settings.COUNTERS_DATABASES = ["default", "other"]
    User = get_user_model()
    for alias in ("default", "other"):
        user = User.objects.db_manager(alias).create(username=f"u-{alias}")
        for _ in range(2 if alias == "default" else 3):
            Notification.objects.using(alias).create(recipient_id=user.pk, verb="v")
    tasks.flush_counters()
    for alias, unread in (("default", 2), ("other", 3)):
        [count] = UnreadCounter.objects.using(alias).values_list("count", flat=True)
        assert count == unread
        last = gather(get_buffer(alias), alias)["last_flush"]
        assert (last["parallel"]["reported"], last["keys"]) == (PARTS, 1)
