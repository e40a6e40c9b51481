"""A Redis Cluster master SIGKILLed under load: no writer fails, and a rebuild ends exact.

Writer processes run every counted path and ``notification_update_counter``
flushes back to back, against a 6-node cluster with 16 shards. A few seconds
in, one master is SIGKILLed and its replica promoted (about 2-3 s with a
1 s node timeout). Pushes to the dead master's shards fail to connect and
fall back to direct DB writes meanwhile; after the promotion they go to the
new master. Then:

* every writer exits cleanly, and no after-commit push raised;
* the drift a promotion leaves (deltas the old master acknowledged but had
  not replicated) is measured against COUNT(*), and so is whether the epoch
  check noticed it; both are printed in one line, the figures of
  docs/how-to/redis-cluster-sentinel.md;
* ``counters_rebuild``, the documented repair after a failover, makes every
  counter exact: stored rows and ``get_count()`` equal COUNT(*).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection

import counters
from counters.base.exceptions import FlushFailed
from counters.models import BufferEpoch, FlushBatch
from tests.chaos.conftest import subprocess_env
from tests.chaos.harness import CommandFlusher, Writers
from tests.chaos.test_chaos import drift, make_users, unread_writer_args
from tests.chaos.trials import epoch_losses, size
from tests.redis_cluster import RedisCluster

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis_cluster,
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="writer and flusher processes share the test database: PostgreSQL only",
    ),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]

WRITERS = 3
USERS = 60
SECONDS = 14.0
KILL_AFTER = 4.0

SETTINGS = {
    "COUNTERS_REDIS_CLUSTER": "1",
    "COUNTERS_SHARDS": "16",
    "COUNTERS_BATCH_SIZE": "50",
    "COUNTERS_LEASE_TIMEOUT": "2",
    "COUNTERS_SOCKET_TIMEOUT": "0.5",
    "COUNTERS_FLUSH_TIME_BUDGET": "5",
    "COUNTERS_AUTO_REBUILD": "0",  # measure the drift; the test runs the repair itself
}


@pytest.fixture
def cluster_settings(settings):
    """A cluster of this test alone, and its settings here and in every subprocess."""
    with RedisCluster() as cluster:
        values = {**SETTINGS, "COUNTERS_REDIS_URL": cluster.url}
        for name, value in values.items():
            setattr(settings, name, value)
        yield cluster, values


def drain(timeout: float = 60.0) -> None:
    """Flush until nothing is pending or in flight (a killed flusher's lease expires first)."""
    buffer = counters.get_buffer()
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = counters.flush()
        except FlushFailed as exc:
            result = exc.result
        pending = sum(buffer.pending_count(s) for s in range(buffer.shards))
        if not (pending or buffer.inflight_ids() or result.busy_shards):
            return
        assert time.monotonic() < deadline, f"still buffered after {timeout:.0f}s"
        time.sleep(0.2)


def test_a_master_failover_under_load_fails_no_writer_and_a_rebuild_ends_exact(
    cluster_settings, tmp_path
):
    cluster, values = cluster_settings
    hot, others = make_users(USERS)
    user_ids = [hot, *others]
    fallback = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK)
    flusher = CommandFlusher(
        [sys.executable, "manage.py"], ROOT, subprocess_env(values, CommandFlusher.APP), tmp_path
    )
    writers = Writers(ROOT, subprocess_env(values, "tally-writer"), tmp_path)
    try:
        flusher.start()
        writers.start(
            WRITERS,
            SECONDS,
            seed=int(time.time()),
            pause=0.003,
            args=unread_writer_args(others, hot),
        )
        time.sleep(KILL_AFTER)
        fallback_before = fallback.count()
        started = time.monotonic()
        killed, promoted = cluster.fail_master()
        promotion = time.monotonic() - started
        reports = writers.wait(SECONDS + 90)
    finally:
        writers.kill()
        flusher.stop(grace=5)
    fallbacks = fallback.count() - fallback_before
    drain()

    ops: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for report in reports:
        ops.update(report["ops"])
        errors.update(report["errors"])
    wrong = drift(user_ids)
    users_wrong, deltas_wrong = size(wrong)
    lost_shards = sorted(BufferEpoch.objects.filter(losses__gt=0).values_list("shard", flat=True))
    print(
        f"\ncluster failover: master {killed} killed, replica {promoted} promoted in "
        f"{promotion:.1f}s; ops={ops.total()} fallback_writes={fallbacks} "
        f"writer_errors={dict(errors)} "
        f"drift_before_rebuild={users_wrong} users/{deltas_wrong} deltas "
        f"epoch_losses={epoch_losses()} (shards {lost_shards}) "
        f"flusher_runs={dict(flusher.exits)}",
        flush=True,
    )
    logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("writer-*.log"))
    assert "Traceback" not in logs and "Error calling" not in logs, logs[-3000:]
    assert not [e for e in errors if "redis" in e.lower()], errors
    assert fallbacks > 0, "no write fell back while the master was down"
    assert flusher.totals["batches"] > 0

    call_command("counters_rebuild", verbosity=0)
    drain()
    assert drift(user_ids) == {}
