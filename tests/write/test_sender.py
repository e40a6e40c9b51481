"""The per-process sender (COUNTERS_SEND_DELAY_MS): queued, batched, read back, drained at exit."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from django.db import connection, transaction

import counters
from counters.models import FlushBatch
from counters.verify.audit import audit
from counters.write import sender
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, cut_redis, in_redis, stored, truth
from tests.procs import ROOT, project_env
from tests.redis_server import free_port

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.serial]


@pytest.fixture
def delay(settings):
    """A sender that holds commits for up to a second unless told to push."""
    settings.COUNTERS_SEND_DELAY_MS = 1000
    settings.COUNTERS_SEND_BATCH = 10_000


def wait_for(predicate, timeout: float = 10.0) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.005)
    return time.monotonic() - started


@pytest.mark.usefixtures("redis_backend")
def test_commits_wait_in_the_queue_and_their_process_reads_them(delay, make_user):
    alice, bob = make_user(), make_user()
    for i in range(3):
        Notification.objects.create(recipient=alice, verb=str(i))
    with transaction.atomic():
        note = Notification.objects.create(recipient=bob, verb="x")
        note.mark_read()
        Notification.objects.create(recipient=bob, verb="y")
    assert (in_redis(alice), in_redis(bob)) == (0, 0)  # nothing pushed yet
    assert UnreadCounter.objects.get_counts([alice.pk, bob.pk]) == {alice.pk: 3, bob.pk: 1}
    assert (truth(alice), truth(bob)) == (3, 1)

    sender.push_queued()
    assert (in_redis(alice), in_redis(bob)) == (3, 1)
    assert sender._senders["default"].batches == 1  # four commits, one push
    assert_exact(alice, bob)


@pytest.mark.usefixtures("redis_backend")
def test_the_thread_pushes_after_the_delay_or_a_full_batch(settings, make_user):
    alice = make_user()
    settings.COUNTERS_SEND_DELAY_MS = 30
    Notification.objects.create(recipient=alice, verb="alone")
    wait_for(lambda: in_redis(alice) == 1)

    settings.COUNTERS_SEND_DELAY_MS = 1000
    settings.COUNTERS_SEND_BATCH = 5
    sender.reset()  # the new settings take effect for the next sender
    Notification.objects.bulk_create([])  # no change, nothing queued
    for i in range(5):
        Notification.objects.create(recipient=alice, verb=str(i))
    waited = wait_for(lambda: in_redis(alice) == 6)
    assert waited < 0.9  # the fifth commit set it off, not the delay
    assert sender._senders["default"].batches == 1
    assert_exact(alice)


def test_a_flush_in_the_process_pushes_its_queue_first(delay, make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="x")
    counters.flush()
    assert stored(alice) == truth(alice) == 1


def test_reads_under_concurrent_commits_never_count_a_delta_twice_or_miss_one(settings, make_user):
    settings.COUNTERS_SEND_DELAY_MS = 5
    alice = make_user()
    writers, per_writer = 3, 40
    seen: list[int] = []
    done = threading.Event()

    def write() -> None:
        try:
            for i in range(per_writer):
                Notification.objects.create(recipient=alice, verb=str(i))
        finally:
            connection.close()

    def read() -> None:
        try:
            while not done.is_set():
                seen.append(UnreadCounter.objects.get_count(alice))
        finally:
            connection.close()

    threads = [threading.Thread(target=write) for _ in range(writers)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    reader.join()
    # Only increments: one reader's successive reads never go down, never pass the truth.
    assert len(seen) > 10
    assert seen == sorted(seen)
    assert max(seen) <= truth(alice) == writers * per_writer
    assert_exact(alice)


def test_redis_down_the_batch_goes_to_the_db_in_one_write(settings, delay, make_user):
    cut_redis(settings)
    alice = make_user()
    fallbacks = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK)
    for i in range(3):
        Notification.objects.create(recipient=alice, verb=str(i))
    assert fallbacks.count() == 0
    assert UnreadCounter.objects.get_count(alice) == 3  # the rows plus this process's queue
    sender.push_queued()
    assert fallbacks.count() == 1
    assert stored(alice) == truth(alice) == 3


def run_writer(user, end: str, notifications: int = 3) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *(sys.executable, "-m", "tests.sender_writer", "--user", str(user.pk)),
            *("--notifications", str(notifications), "--end", end),
        ],
        cwd=ROOT,
        env=project_env(COUNTERS_SEND_DELAY_MS="1000", COUNTERS_SEND_BATCH="10000"),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("end", ["exit", "multiprocessing", "fork"])
def test_a_process_that_ends_pushes_its_queue_once(end, make_user):
    alice = make_user()
    proc = run_writer(alice, end)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "queued 3"  # still queued when it ended
    assert in_redis(alice) == truth(alice) == 3  # pushed once: a forked child pushed nothing
    assert_exact(alice)


def test_a_gunicorn_worker_shut_down_by_its_master_pushes_its_queue(make_user):
    """gunicorn's graceful shutdown (SIGTERM to the master) ends the worker through its
    ``worker_exit`` hook (config/gunicorn.py) and interpreter exit: the queue is pushed."""
    alice = make_user()
    port = free_port()
    # A delay beyond the check's limit (gunicorn runs no system checks): no timer pushes
    # the queue before the worker ends, only its exit does.
    env = project_env(COUNTERS_SEND_DELAY_MS="60000", COUNTERS_SEND_BATCH="10000")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "gunicorn", "--config", "python:config.gunicorn"),
            *("--bind", f"127.0.0.1:{port}", "--workers", "1", "--graceful-timeout", "20"),
            "tests.sender_wsgi:app",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                url = f"http://127.0.0.1:{port}/?user={alice.pk}&notifications=3"
                with urllib.request.urlopen(url, timeout=10) as response:
                    body = response.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "gunicorn did not answer"
                time.sleep(0.1)
        assert body == "queued 3"  # committed, and still in the worker's queue
        assert in_redis(alice) == 0
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert in_redis(alice) == truth(alice) == 3
    assert_exact(alice)


def test_a_killed_process_loses_its_queue_and_the_audit_repairs_it(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")
    counters.flush()
    proc = run_writer(alice, "sigkill")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.splitlines()[0] == "queued 3"
    assert truth(alice) == 4
    assert UnreadCounter.objects.get_count(alice) == 1  # the three queued deltas are gone
    result = audit(names=["unread"], confirm_delay=0.05)
    assert result.repaired == 1
    assert_exact(alice)


def test_counters_status_says_what_the_write_path_trades(settings):
    import json
    from io import StringIO

    from django.core.management import call_command

    def status() -> tuple[str, dict]:
        text, data = StringIO(), StringIO()
        call_command("counters_status", stdout=text)
        call_command("counters_status", "--json", stdout=data)
        return text.getvalue(), json.loads(data.getvalue())["write_path"]

    text, write_path = status()  # the default: the sender, every 200 ms
    assert write_path["mode"] == "sender"
    assert write_path["send_delay_ms"] == 200
    assert "write path: per-process sender, every 200 ms or 500 commits; trades: " in text
    assert "a process killed with SIGKILL loses up to 200 ms of its commits" in text
    settings.COUNTERS_SEND_DELAY_MS = 0
    text, write_path = status()
    assert "write path: each COMMIT pushes its deltas before returning" in text
    assert write_path == {
        "mode": "per-commit",
        "send_delay_ms": 0,
        "send_batch": None,
        "write_batch": 1,
        "trades": None,
    }
    settings.COUNTERS_DEFER_ACKS = True
    settings.COUNTERS_WRITE_BATCH = 16
    text, write_path = status()
    assert write_path["mode"] == "batched" and write_path["write_batch"] == 16
    assert "write path: pushes written 16 at a time outside a request; trades: " in text
    assert "a process killed with SIGKILL loses up to 15 of its commits not yet written" in text
    settings.COUNTERS_DURABLE = True
    text, write_path = status()
    assert write_path["trades"].endswith("a process killed loses nothing (durable mode)")
    settings.COUNTERS_DURABLE = False
    settings.COUNTERS_WRITE_BATCH = 1
    settings.COUNTERS_SEND_DELAY_MS = 5
    text, write_path = status()
    assert write_path["mode"] == "sender"
    assert write_path["send_delay_ms"] == 5
    assert (
        "write path: per-process sender, every 5 ms or 500 commits; trades: outside a request "
        "or a Celery task, other " in text
    )
    assert "a process killed with SIGKILL loses up to 5 ms of its commits" in text
    settings.COUNTERS_DURABLE = True
    text, write_path = status()
    assert write_path["trades"].endswith("later; a process killed loses nothing (durable mode)")
