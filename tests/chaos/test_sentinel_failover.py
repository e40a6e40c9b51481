"""A Sentinel-managed master SIGKILLed under load: no writer fails, and a rebuild ends exact.

Writer processes run every counted path and ``notification_update_counter``
flushes back to back, through three sentinels (``COUNTERS_REDIS_SENTINELS``)
that watch a master and its replica. A few seconds in, the master is
SIGKILLed; the sentinels see it down after ``down-after-milliseconds`` (1 s
here), agree, and promote the replica. Meanwhile a push cannot connect (the
master is gone, then no sentinel names a master) and falls back to a direct
DB write; after the promotion the writers' next connections go to the new
master. Then:

* every writer exits cleanly, and no after-commit push raised;
* the drift the promotion left (deltas the old master acknowledged but had
  not replicated) is measured against COUNT(*), and so is whether the epoch
  check noticed it; both are printed in one line, the figures of
  docs/how-to/redis-cluster-sentinel.md;
* ``counters_rebuild``, the documented repair after a failover, makes every
  counter exact: stored rows and ``get_count()`` equal COUNT(*).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection

from counters.models import BufferEpoch, FlushBatch
from tests.chaos.conftest import subprocess_env
from tests.chaos.harness import CommandFlusher, Writers
from tests.chaos.test_chaos import drift, make_users, unread_writer_args
from tests.chaos.test_cluster_failover import drain
from tests.chaos.trials import epoch_losses, size
from tests.redis_sentinel import SentinelSet

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis_sentinel,
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="writer and flusher processes share the test database: PostgreSQL only",
    ),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]

WRITERS = 3
USERS = 60
SECONDS = 14.0
KILL_AFTER = 4.0

SETTINGS = {
    "COUNTERS_SHARDS": "16",
    "COUNTERS_BATCH_SIZE": "50",
    "COUNTERS_LEASE_TIMEOUT": "2",
    "COUNTERS_SOCKET_TIMEOUT": "0.5",
    "COUNTERS_FLUSH_TIME_BUDGET": "5",
    "COUNTERS_AUTO_REBUILD": "0",  # measure the drift; the test runs the repair itself
}


@pytest.fixture
def sentinel_settings(settings):
    """A sentinel set of this test alone, and its settings here and in every subprocess."""
    with SentinelSet() as sentinels:
        values = {
            **SETTINGS,
            "COUNTERS_REDIS_SENTINELS": ",".join(sentinels.sentinels),
            "COUNTERS_REDIS_SENTINEL_SERVICE": sentinels.service,
            "COUNTERS_REDIS_URL": sentinels.url,
        }
        for name, value in values.items():
            setattr(settings, name, value)
        yield sentinels, values


def test_a_master_failover_under_load_fails_no_writer_and_a_rebuild_ends_exact(
    sentinel_settings, tmp_path
):
    sentinels, values = sentinel_settings
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
        killed, promoted, promotion = sentinels.fail_master()
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
        f"\nsentinel failover: master {killed} killed, replica {promoted} promoted in "
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
    assert ops.total() > 0
    assert fallbacks > 0, "no write fell back while the master was down"
    assert flusher.totals["batches"] > 0
    assert sentinels.master_port() == promoted

    call_command("counters_rebuild", verbosity=0)
    drain()
    assert drift(user_ids) == {}
