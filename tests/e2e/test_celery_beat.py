"""End to end: a real Celery beat (DatabaseScheduler) and worker keep the stored counters exact.

The test process changes notifications; it never flushes. A ``celery beat``
subprocess reads the periodic tasks from the test database and sends
``counters.flush`` and ``counters.audit`` every second through a Redis broker
database of this test alone; a ``celery worker`` subprocess runs them against
the same database and the same Redis key prefix. The stored ``UnreadCounter``
rows must reach the COUNT(*) truth, twice in a row, through ledgered flush
batches, and a third time after raw SQL corrupted one, repaired by the audit.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.db.models import F

from counters.buffer.connections import redis_scheme
from counters.models import AuditRepair, FlushBatch
from counters.ops.schedule import ensure_audit_task, ensure_periodic_task
from notifications.models import Notification, UnreadCounter
from tests.e2e.celery_procs import CeleryProcs
from tests.helpers import stored, truth
from tests.procs import project_env

BROKER_DB = 14  # a Redis database of its own: no other worker consumes these tasks
CONVERGE_TIMEOUT = 45.0

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="e2e: worker and beat subprocesses share the test database only on PostgreSQL",
    ),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(120),
]


def broker_url() -> str:
    """Database BROKER_DB of the Redis at REDIS_URL (a valkey:// URL written redis://, as
    Celery reads it)."""
    base, _, _ = redis_scheme(settings.REDIS_URL).rpartition("/")
    return f"{base}/{BROKER_DB}"


@pytest.fixture
def broker() -> Iterator[str]:
    url = broker_url()
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def celery_procs(transactional_db, counters_prefix, broker, tmp_path) -> Iterator[CeleryProcs]:
    """Worker and beat against the test database, this test's key prefix and broker."""
    ensure_periodic_task(interval=1)
    ensure_audit_task(interval=1)
    env = project_env(
        CELERY_BROKER_URL=broker,
        COUNTERS_KEY_PREFIX=counters_prefix,
        COUNTERS_SOCKET_TIMEOUT="0.5",  # the audit's confirming readings 1.2 s apart
        DJANGO_SETTINGS_MODULE="config.settings",
        LOG_LEVEL="INFO",
    )
    procs = CeleryProcs(env, tmp_path)
    try:
        procs.start(
            "worker",
            "worker",
            "--pool=solo",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            f"--hostname=e2e-{counters_prefix}@%h",
        )
        procs.beat()
        yield procs
    finally:
        procs.stop()
        # pytest shows this ("Captured stdout teardown") only when the test fails.
        print(procs.output())


def wait_for(procs: CeleryProcs, what: str, condition: Callable[[], bool]) -> float:
    """Poll ``condition`` until it holds; fail with the subprocess output if it does not."""
    start = time.monotonic()
    while not condition():
        procs.check_alive()
        if time.monotonic() - start > CONVERGE_TIMEOUT:
            pytest.fail(f"not within {CONVERGE_TIMEOUT:.0f} s: {what} (celery output below)")
        time.sleep(0.2)
    return time.monotonic() - start


def converged(users, expected: list[int]) -> Callable[[], bool]:
    def check() -> bool:
        return [stored(u) for u in users] == expected

    return check


def test_beat_and_worker_keep_stored_counts_exact(celery_procs, make_user):
    users = [make_user() for _ in range(3)]

    # Round 1: creates, idempotent reads, a bulk read, deletes and a fan-out.
    notes = {}
    for i, user in enumerate(users):
        notes[user.pk] = [
            Notification.objects.create(recipient=user, verb=f"n{j}") for j in range(3 + i)
        ]
        assert notes[user.pk][0].mark_read() is True
        # A stale instance of the same row: the second read changes nothing.
        assert Notification.objects.get(pk=notes[user.pk][0].pk).mark_read() is False
    assert Notification.objects.filter(recipient=users[0]).mark_all_read() == 2
    Notification.objects.create(recipient=users[0], verb="after read-all")
    notes[users[1].pk][1].delete()  # unread: -1
    notes[users[1].pk][0].delete()  # read: 0
    assert Notification.objects.notify(users, verb="fan-out") == 3
    expected = [2, 3, 5]
    assert [truth(u) for u in users] == expected

    took = wait_for(celery_procs, "round 1 stored == truth", converged(users, expected))
    first_batches = set(FlushBatch.objects.values_list("batch_id", flat=True))
    assert first_batches, "the counters reached the truth without a ledgered flush batch"

    # Round 2: the schedule keeps running; counts go up, down and to zero.
    for _ in range(3):
        Notification.objects.create(recipient=users[0], verb="more")
    assert Notification.objects.filter(recipient=users[1]).delete()[0] == 3
    assert Notification.objects.filter(recipient=users[2]).mark_all_read() == 5
    Notification.objects.create(recipient=users[2], verb="last")
    expected = [5, 0, 1]
    assert [truth(u) for u in users] == expected

    took += wait_for(celery_procs, "round 2 stored == truth", converged(users, expected))
    print(f"stored counts converged in {took:.1f} s over two rounds")
    assert not AuditRepair.objects.exists()  # nothing was wrong: the audit repaired nothing

    # Round 3: raw SQL corrupts a stored row; the periodic audit repairs it, the flush stores it.
    UnreadCounter.objects.filter(user=users[0]).update(count=F("count") + 7)
    repaired = converged(users, expected)
    took = wait_for(
        celery_procs,
        "round 3 audit repair stored",
        lambda: AuditRepair.objects.exists() and repaired(),
    )
    print(f"the audit repaired the corrupted row in {took:.1f} s")
    assert list(AuditRepair.objects.values_list("key", "stored", "buffered", "truth")) == [
        (str(users[0].pk), 12, 0, 5)
    ]

    for user in users:
        # Nothing left buffered: the exact read equals the stored row and the truth.
        assert (user.pk, UnreadCounter.objects.get_count(user)) == (user.pk, truth(user))
        assert (user.pk, stored(user)) == (user.pk, truth(user))
    batches = FlushBatch.objects.all()
    assert set(batches.values_list("kind", flat=True)) == {FlushBatch.Kind.FLUSH}
    assert set(batches.values_list("batch_id", flat=True)) - first_batches

    # The worker logs one line per run that did something, from the task itself;
    # Celery's own "received" and "succeeded" lines of each run stay at DEBUG.
    log = (celery_procs.logdir / "worker.log").read_text()
    assert "Task counters.flush[" not in log
    assert "Task counters.audit[" not in log
    lines = re.findall(r" INFO counters\.tasks (.*)", log)
    assert lines, "no run with work was logged"
    idle = re.compile(r"flushed 0 batches, 0 keys, 0 deltas in \S+")
    assert [line for line in lines if idle.fullmatch(line)] == []
