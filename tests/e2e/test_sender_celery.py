"""End to end: a Celery prefork child pushes its sender's queue as the worker shuts down.

A prefork child ends with ``os._exit()``, so ``atexit`` never runs there:
Celery's ``worker_process_shutdown`` is what pushes the deltas it still holds.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
from celery import Celery

from tests.e2e.celery_procs import CeleryProcs, signal_group
from tests.e2e.celery_writes import WRITE_TASK_NAME, WROTE
from tests.helpers import assert_exact, in_redis, truth
from tests.procs import project_env
from tests.redis_server import RedisServer

pytestmark = [
    pytest.mark.redis,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(180),
]


@pytest.fixture
def broker() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


def test_a_prefork_child_pushes_its_queue_at_warm_shutdown(
    broker, counters_prefix, tmp_path, make_user
):
    alice = make_user()
    procs = CeleryProcs(
        project_env(
            CELERY_BROKER_URL=broker,
            COUNTERS_KEY_PREFIX=counters_prefix,
            COUNTERS_SEND_DELAY_MS="1000",
            COUNTERS_SEND_BATCH="100000",
        ),
        tmp_path,
    )
    worker = procs.start(
        "worker",
        "worker",
        *("--pool=prefork", "--concurrency=1", "--without-gossip", "--without-mingle"),
        "--without-heartbeat",
        app="tests.e2e.celery_writes",
    )
    client = Celery("sender-test", broker=broker, set_as_current=False)
    try:
        client.send_task(WRITE_TASK_NAME, args=[alice.pk, 5])
        deadline = time.monotonic() + 90
        # Until the task is done: a shutdown signal during the task would end its child early.
        while WROTE.format(count=5, user_id=alice.pk) not in procs.log("worker"):
            procs.check_alive("worker")
            assert time.monotonic() < deadline, procs.output()
            time.sleep(0.01)
        signal_group(worker, signal.SIGTERM)  # warm shutdown, while the deltas wait
        worker.wait(60)
        assert worker.returncode == 0, procs.output()
        assert "could not" not in procs.log("worker")
        assert in_redis(alice) == truth(alice) == 5, procs.output()
        assert_exact(alice)
    finally:
        client.close()
        procs.stop()
