"""Parallel flush with real Celery workers: disjoint shards at once, a killed worker, overlaps.

Worker subprocesses run the project's worker with a fault injected into the
flush (``tests/e2e/celery_faults.py``): a slow or hanging batch, so that a
kill lands mid-flush and parts overlap for certain. Each test has a broker of
its own (a throwaway ``redis-server``) and its own Redis key prefix. Counts
are compared with ``COUNT(*)``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery
from django.db import connection

import counters
from counters.base.registry import get_spec
from counters.base.utils import to_str
from counters.models import FlushBatch
from counters.ops.fanout import last_run, partition, run_key
from counters.ops.schedule import ensure_periodic_task
from counters.tasks import PART_TASK_NAME
from notifications.apps import UNREAD_COUNTER
from notifications.models import Notification
from tests.e2e.celery_procs import CeleryProcs
from tests.helpers import stored, truth
from tests.procs import project_env
from tests.redis_server import RedisServer

FAULT_APP = "tests.e2e.celery_faults"
CONVERGE_TIMEOUT = 90.0

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.redis,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]


@pytest.fixture
def broker() -> Iterator[str]:
    """Celery's broker: a redis-server of this test alone."""
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def fault_log(tmp_path) -> Path:
    return tmp_path / "faults.jsonl"


@pytest.fixture
def celery(transactional_db, counters_prefix, broker, fault_log, tmp_path):
    """``celery(**env)``: a CeleryProcs on this test's database, prefix and broker."""
    made: list[CeleryProcs] = []

    def make(**env: str) -> CeleryProcs:
        procs = CeleryProcs(
            project_env(
                CELERY_BROKER_URL=broker,
                COUNTERS_KEY_PREFIX=counters_prefix,
                LOG_LEVEL="INFO",
                TALLY_TEST_FAULT_LOG=str(fault_log),
                **env,
            ),
            tmp_path,
        )
        made.append(procs)
        return procs

    yield make
    for procs in made:
        procs.stop()
        # pytest shows this ("Captured stdout teardown") only when the test fails.
        print(procs.output())


def wait_for(procs: CeleryProcs, what: str, condition: Callable[[], object], *alive: str):
    """Poll ``condition`` until it is true; fail with the subprocesses' output if it is not."""
    start = time.monotonic()
    while not (value := condition()):
        procs.check_alive(*alive)
        if time.monotonic() - start > CONVERGE_TIMEOUT:
            pytest.fail(f"not within {CONVERGE_TIMEOUT:.0f} s: {what} (celery output below)")
        time.sleep(0.05)
    return value


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def notify_spread(users, rounds: int = 1) -> None:
    """Unread and read notifications for every user: deltas in every shard."""
    for i, user in enumerate(users):
        for j in range((i + rounds) % 3 + 1):
            note = Notification.objects.create(recipient=user, verb=f"n{rounds}.{j}")
            if (i + j) % 4 == 0:
                note.mark_read()


def converged(users) -> Callable[[], bool]:
    expected = [truth(u) for u in users]
    return lambda: [stored(u) for u in users] == expected


def shard_of(user) -> int:
    return counters.get_buffer().shard_of(get_spec(UNREAD_COUNTER).member(user.pk))


def overlapping(intervals: list[tuple[int, float, float]]) -> bool:
    """Two (pid, start, end) intervals of different processes that intersect."""
    return any(
        a[0] != b[0] and a[1] < b[2] and b[1] < a[2]
        for i, a in enumerate(intervals)
        for b in intervals[i + 1 :]
    )


def test_beat_fans_out_to_workers_that_flush_disjoint_shards_at_once(celery, make_user, fault_log):
    users = [make_user() for _ in range(48)]
    notify_spread(users)
    ensure_periodic_task(interval=1)
    procs = celery(COUNTERS_FLUSH_PARALLELISM="2", TALLY_TEST_FAULT="slow-apply:0.3")
    procs.worker("w1", app=FAULT_APP)
    procs.worker("w2", app=FAULT_APP)
    procs.beat()

    wait_for(procs, "stored == truth", converged(users))
    assert [stored(u) for u in users] == [truth(u) for u in users]

    applied = events(fault_log)
    starts = {e["batch"]: e for e in applied if e["event"] == "apply-start"}
    ends = {e["batch"]: e for e in applied if e["event"] == "apply-end"}
    # Each batch was applied once, by one process, and is in the ledger once.
    assert len(starts) == len([e for e in applied if e["event"] == "apply-start"])
    assert set(ends) <= set(FlushBatch.objects.values_list("batch_id", flat=True))
    # Both workers applied batches, and at the same time where the database lets them:
    # SQLite has one write lock, so there the transactions take turns.
    assert len({e["pid"] for e in starts.values()}) == 2
    intervals = [(s["pid"], s["at"], ends[b]["at"]) for b, s in starts.items() if b in ends]
    assert overlapping(intervals) or connection.vendor == "sqlite", intervals
    # Within one run, part i flushed shards i, i + 2, ...: disjoint, every shard once.
    buffer = counters.get_buffer()
    run = wait_for(
        procs,
        "a run with both parts reported",
        lambda: (r := last_run(buffer)) and r["parallel"]["reported"] == 2 and r,
    )
    assert run["parallel"]["parts"] == 2
    assert [run["parallel"]["shards"][str(i)] for i in range(2)] == partition(buffer.shards, 2)
    assert run["failed_shards"] == {}

    # The schedule keeps running: later writes converge too.
    notify_spread(users, rounds=2)
    wait_for(procs, "round 2 stored == truth", converged(users))
    assert FlushBatch.objects.exclude(kind=FlushBatch.Kind.FLUSH).count() == 0


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param("hang-apply", id="killed-mid-transaction"),
        pytest.param("hang-ack", id="killed-after-commit-before-ack"),
    ],
)
def test_a_worker_killed_mid_flush_loses_nothing(celery, make_user, fault_log, fault):
    users = [make_user() for _ in range(32)]
    notify_spread(users)
    ensure_periodic_task(interval=1)
    procs = celery(
        COUNTERS_FLUSH_PARALLELISM="2", COUNTERS_LEASE_TIMEOUT="2", TALLY_TEST_FAULT=fault
    )
    workers = {"w1": procs.worker("w1", app=FAULT_APP), "w2": procs.worker("w2", app=FAULT_APP)}
    procs.beat()

    [hung] = wait_for(
        procs, "a batch hanging", lambda: [e for e in events(fault_log) if e["event"] == "hang"]
    )
    [victim] = [name for name, proc in workers.items() if proc.pid == hung["pid"]]
    [survivor] = set(workers) - {victim}
    procs.kill(victim)

    notify_spread(users, rounds=2)  # the survivor flushes new deltas too
    wait_for(procs, "stored == truth", converged(users), survivor, "beat")
    buffer = counters.get_buffer()
    wait_for(
        procs,
        "the hung batch acknowledged",
        lambda: hung["batch"] not in buffer.inflight_ids().values(),
        survivor,
    )
    assert [stored(u) for u in users] == [truth(u) for u in users]
    # The survivor took the in-flight batch over once its lease expired: applied once.
    assert FlushBatch.objects.filter(pk=hung["batch"]).count() == 1
    assert f"recovering in-flight batch {hung['batch']} of shard {hung['shard']}" in procs.log(
        survivor
    )


def test_overlapping_parts_do_not_apply_a_batch_twice(celery, make_user, fault_log, broker):
    """Part B takes over a shard whose lease expired while part A was applying its batch."""
    candidates = [make_user() for _ in range(64)]
    shard = shard_of(candidates[0])
    users = [u for u in candidates if shard_of(u) == shard]
    notify_spread(users)
    procs = celery(COUNTERS_LEASE_TIMEOUT="1", TALLY_TEST_FAULT="slow-first-apply:4")
    procs.worker("wa", "--queues=part-a", app=FAULT_APP)
    procs.worker("wb", "--queues=part-b", app=FAULT_APP)
    buffer = counters.get_buffer()
    client = Celery("tally-test", broker=broker, set_as_current=False)  # a sender only
    try:
        part = {"using": "default", "shards": [shard], "run": "overlap", "parts": 2}
        client.send_task(PART_TASK_NAME, kwargs={**part, "index": 0}, queue="part-a")
        wait_for(
            procs,
            "part A applying",
            lambda: any(e["event"] == "apply-start" for e in events(fault_log)),
        )
        # Part A is still inside its transaction, and its lease has expired.
        wait_for(procs, "A's lease expired", lambda: not buffer.client.exists(lease(buffer, shard)))
        assert not any(e["event"] == "apply-end" for e in events(fault_log))
        client.send_task(PART_TASK_NAME, kwargs={**part, "index": 1}, queue="part-b")
    finally:
        client.close()

    reports = wait_for(procs, "both parts reported", lambda: parts_reported(buffer, "overlap", 2))
    a, b = (report["result"] for report in reports)
    assert (a["batches"], a["keys"]) == (1, len(users))
    # B found the batch in flight and recovered it; the ledger let only one apply it.
    assert (b["recovered"], b["already_applied"], b["batches"]) == (1, 1, 0)
    [started] = [e for e in events(fault_log) if e["event"] == "apply-start"]
    assert FlushBatch.objects.filter(pk=started["batch"]).count() == 1
    assert FlushBatch.objects.count() == 1
    assert [stored(u) for u in users] == [truth(u) for u in users]
    assert buffer.inflight_ids() == {}


def lease(buffer, shard: int) -> str:
    return buffer.key(shard, "lease")


def parts_reported(buffer, run: str, parts: int) -> list[dict] | None:
    raw = {to_str(k): to_str(v) for k, v in buffer.client.hgetall(run_key(buffer)).items()}
    reports = [raw.get(f"part:{run}:{i}") for i in range(parts)]
    if None in reports:
        return None
    return [json.loads(r) for r in reports if r is not None]
