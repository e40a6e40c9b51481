"""End to end: gunicorn (Procfile.production, two workers) serves ``/metrics`` for a Celery
prefork worker that flushes, through one ``PROMETHEUS_MULTIPROC_DIR``.

The flush tasks run in Celery's pool children; a gunicorn worker answers the
scrape with what they counted. A gunicorn worker killed with SIGKILL has its
live gauge dropped by the master's ``child_exit`` hook (``config/gunicorn.py``);
Celery's children drop theirs on ``worker_process_shutdown`` when the worker
stops. What the dead processes counted stays in the scrape.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from django.conf import settings

from counters.buffer.connections import redis_scheme
from notifications.models import Notification
from tests.helpers import stored, truth
from tests.metrics_scrape import Scrape
from tests.web.test_production import (
    fetch,
    free_port,
    procfile_command,
    production_env,
    wait_for_port,
)

ROOT = Path(__file__).resolve().parents[2]
BROKER_DB = 13  # tasks go to a queue of this test alone
TIMEOUT = 45.0

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.redis,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(180),
    pytest.mark.usefixtures("per_commit"),  # the test's own commits are in Redis when it flushes
]


def broker_url() -> str:
    """Database BROKER_DB of the Redis at REDIS_URL (a valkey:// URL written redis://, as
    Celery reads it)."""
    base, _, _ = redis_scheme(settings.REDIS_URL).rpartition("/")
    return f"{base}/{BROKER_DB}"


def children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def live_gauge_pids(directory: Path) -> set[int]:
    return {
        int(m[1])
        for p in directory.glob("gauge_livesum_*.db")
        if (m := re.fullmatch(r"gauge_livesum_(\d+)\.db", p.name))
    }


def wait_for(what: str, condition: Callable[[], bool], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        for proc in procs:
            assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        if time.monotonic() > deadline:
            pytest.fail(f"not within {TIMEOUT:.0f} s: {what}")
        time.sleep(0.2)


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture
def servers(counters_prefix, tmp_path) -> Iterator[dict]:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    queue = f"metrics-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = production_env(
        PORT=str(port),
        WEB_CONCURRENCY="2",
        COUNTERS_METRICS="1",
        PROMETHEUS_MULTIPROC_DIR=str(directory),
        CELERY_BROKER_URL=broker_url(),
        COUNTERS_KEY_PREFIX=counters_prefix,
    )
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    web_command = ["sh", "-c", f"exec {procfile_command('Procfile.production', 'web')}"]
    worker_command = [
        *(sys.executable, "-m", "celery", "-A", "config", "worker", "--loglevel=INFO"),
        *("--pool=prefork", "--concurrency=2", "-Q", queue, f"--hostname={queue}@%h"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat"),
    ]
    web = start(web_command, env, tmp_path / "web.log")
    worker = start(worker_command, env, tmp_path / "worker.log")
    app = Celery("metrics-test", broker=broker_url(), set_as_current=False)
    try:
        wait_for_port(web, port, time.monotonic() + 60)
        yield {
            "url": f"http://127.0.0.1:{port}/metrics",
            "dir": directory,
            "web": web,
            "worker": worker,
            "flush": lambda: app.send_task("counters.flush", queue=queue),
        }
    finally:
        app.close()
        for proc in (worker, web):
            if proc.poll() is None:
                stop(proc)
        broker = redis.Redis.from_url(broker_url())
        for key in broker.scan_iter(match=f"*{queue}*"):  # the queue and its bindings
            broker.delete(key)
        broker.close()
        for name in ("web", "worker"):
            print(f"----- {name} -----\n{(tmp_path / f'{name}.log').read_text()[-10_000:]}")


def scrape(url: str) -> Scrape:
    status, _, body = fetch(url)
    assert status == 200, body[:500]
    return Scrape.parse(body.decode())


def flush_runs(url: str) -> float:
    return scrape(url).value("tally_flush_runs_total", outcome="ok")


def test_gunicorn_serves_what_celery_children_counted(servers, make_user):
    url, directory = servers["url"], servers["dir"]
    procs = [servers["web"], servers["worker"]]
    users = [make_user() for _ in range(5)]

    for user in users[:3]:
        Notification.objects.create(recipient=user, verb="first")
    servers["flush"]()
    wait_for("one flush", lambda: flush_runs(url) == 1, procs)
    first = scrape(url)
    assert first.value("tally_flushed_keys_total") == 3
    assert first.total("tally_backlog_keys") == 0
    for user in users:
        Notification.objects.create(recipient=user, verb="second")
    servers["flush"]()
    wait_for("two flushes", lambda: flush_runs(url) == 2, procs)
    second = scrape(url)
    assert second.value("tally_flushed_keys_total") == 8
    assert second.value("tally_flushed_deltas_total") == 8
    assert second.value("tally_flush_in_progress") == 0
    assert [stored(u) for u in users] == [truth(u) for u in users] == [2, 2, 2, 1, 1]

    master = servers["web"].pid
    web_workers = children(master)
    assert len(web_workers) == 2
    celery_children = live_gauge_pids(directory) - web_workers
    assert celery_children, "no Celery child recorded a flush"
    assert celery_children <= children(servers["worker"].pid)

    # A gunicorn worker killed outright: the master's child_exit drops its live gauge.
    served = live_gauge_pids(directory) & web_workers
    assert served, "no gunicorn worker answered a scrape"
    victim = min(served)
    os.kill(victim, signal.SIGKILL)
    wait_for("child_exit", lambda: victim not in live_gauge_pids(directory), procs)

    # Celery stops: each pool child drops its live gauge as it exits.
    stop(servers["worker"])
    assert live_gauge_pids(directory) & celery_children == set()
    final = scrape(url)  # what the dead processes counted is still there
    assert final.value("tally_flush_runs_total", outcome="ok") == 2
    assert final.value("tally_flushed_keys_total") == 8
