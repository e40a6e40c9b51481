"""Durable mode (COUNTERS_DURABLE): nothing lost when a writer dies between COMMIT and its push.

Real processes SIGKILLed, real Redis, the configured database; every count is
compared with ``COUNT(*)`` of the notifications (the ground truth).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

import counters
from counters.buffer.store import Buffer
from counters.client import get_buffer
from counters.models import AuditRepair, FlushBatch, Outbox
from counters.verify.audit import audit
from counters.verify.rebuild import rebuild
from counters.write import delivery, durable, fallback, outbox
from counters.write.negatives import queue_key
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth
from tests.procs import ROOT, project_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]

GRACE = 0.5


@pytest.fixture(autouse=True)
def durable_mode(settings):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5  # the rebuild's confirm delay: 1.2 s
    settings.COUNTERS_DURABLE = True
    settings.COUNTERS_OUTBOX_GRACE = GRACE


def past_grace() -> None:
    time.sleep(GRACE + 0.2)


class DeadWriter:
    """Within it, ``send`` does nothing: a writer "dies" right after its COMMIT (in-process)."""

    def __init__(self) -> None:
        self.patch = pytest.MonkeyPatch()

    def __enter__(self) -> None:
        self.patch.setattr(delivery, "send", lambda *args, **kwargs: None)

    def __exit__(self, *exc: object) -> None:
        self.patch.undo()


@pytest.fixture
def dead_writer():
    dead = DeadWriter()
    yield dead
    dead.patch.undo()


def test_the_row_is_written_in_the_transaction_and_deleted_after_the_push(make_user, monkeypatch):
    alice = make_user()
    events: list[tuple[str, str, bool]] = []
    real_push, real_write = Buffer.push, outbox.write

    def push(self, deltas, push_id):
        events.append(("push", str(push_id), connection.in_atomic_block))
        return real_push(self, deltas, push_id)

    def write(deltas, using, push_id):
        events.append(("write", push_id, connection.in_atomic_block))
        return real_write(deltas, using, push_id)

    monkeypatch.setattr(Buffer, "push", push)
    monkeypatch.setattr(outbox, "write", write)
    with transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
        Notification.objects.create(recipient=alice, verb="b")
        assert events == []  # nothing before the COMMIT
    Notification.objects.create(recipient=alice, verb="autocommit")
    first, second = events[0][1], events[2][1]
    assert first != second  # one row (and push id) per transaction
    assert [e[:2] for e in events] == [
        ("write", first),
        ("push", first),
        ("write", second),
        ("push", second),
    ]
    assert Outbox.objects.count() == 0  # each deleted after its push
    if connection.vendor == "postgresql":  # the DELETE's async commit was for it alone
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone() == ("on",)
    assert_exact(alice)


def test_a_rolled_back_transaction_leaves_no_row(make_user):
    alice = make_user()
    with pytest.raises(RuntimeError), transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
        raise RuntimeError("rolled back")
    assert Outbox.objects.count() == 0
    assert_exact(alice)


def test_off_writes_no_row(settings, make_user, monkeypatch):
    settings.COUNTERS_DURABLE = False
    inserts: list[str] = []
    monkeypatch.setattr(outbox, "write", lambda *args: inserts.append("row"))
    alice = make_user()
    with transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
    assert inserts == []
    assert_exact(alice)


@pytest.mark.parametrize("at", ["push", "pushed", "on_commit"])
def test_a_writer_killed_right_after_commit_is_exact_after_the_next_flush_past_the_grace(
    at, make_user
):
    users = [make_user() for _ in range(3)]
    for i, user in enumerate(users):
        for _ in range(i + 1):
            Notification.objects.create(recipient=user, verb="v")
    counters.flush()
    victim = users[1]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.killed_writer", "--user", str(victim.pk), "--at", at],
        cwd=ROOT,
        env=project_env(COUNTERS_DURABLE="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert truth(victim) == 3  # the change committed
    rows = list(Outbox.objects.values_list("deltas", flat=True))
    if at == "on_commit":
        # The push and the row's DELETE come before Django's on_commit callbacks.
        assert rows == []
    else:
        assert rows == [{f"unread:{victim.pk}": 1}]  # left behind by the dead writer
    behind = truth(victim) - UnreadCounter.objects.get_count(victim)
    assert behind == (1 if at == "push" else 0)
    counters.flush()  # within the grace: the row is left to its writer
    assert Outbox.objects.count() == len(rows)
    past_grace()
    counters.flush()
    assert Outbox.objects.count() == 0
    assert stored(victim) == truth(victim) == 3  # counted exactly once, whichever case
    assert_exact(*users)


def test_redis_down_during_commit_writes_directly_and_deletes_the_row(
    own_redis, settings, make_user
):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")
    counters.flush()
    own_redis.kill()
    try:
        before = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count()
        with transaction.atomic():
            Notification.objects.create(recipient=alice, verb="in a transaction")
        Notification.objects.create(recipient=alice, verb="autocommit")
        assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count() == before + 2
        assert Outbox.objects.count() == 0  # deleted with each direct write
        assert stored(alice) == truth(alice) == 3
    finally:
        own_redis.start()
    past_grace()
    assert_exact(alice)  # nothing pushed again by the flush


def test_a_flush_that_took_the_row_makes_the_late_direct_write_a_no_op(make_user, dead_writer):
    alice = make_user()
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
    (row,) = Outbox.objects.all()
    past_grace()
    counters.flush()  # pushes it and deletes it
    # The writer was only slow: Redis failed for it, and it falls back to the DB now.
    fallback.write_direct(row.deltas, "default", push_id=row.push_id, outbox=row.push_id)
    assert not FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).exists()
    assert_exact(alice)


def test_a_slow_writer_pushing_after_the_flush_counts_once(make_user, dead_writer):
    alice = make_user()
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
    (row,) = Outbox.objects.all()
    past_grace()
    counters.flush()
    delivery.send(row.deltas, "default", push_id=row.push_id, outbox=True)  # the same push id
    assert_exact(alice)


@pytest.mark.parametrize("landed", [False, True], ids=["never-pushed", "pushed-long-ago"])
def test_rows_older_than_the_push_id_lifetime_are_repaired_not_pushed(
    landed, make_user, dead_writer, caplog
):
    alice = make_user()
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
        Notification.objects.create(recipient=alice, verb="a")
    (row,) = Outbox.objects.all()
    buffer = get_buffer()
    if landed:  # its push did land, but Redis no longer remembers the push id
        buffer.push(row.deltas, row.push_id)
        writer = row.push_id.split(":")[0]
        buffer.client.delete(*buffer.client.keys(f"{buffer.prefix}:*:w:{writer}"))
    old = timezone.now() - timedelta(seconds=outbox.OUTBOX_SAFE_AGE + 5)
    Outbox.objects.filter(pk=row.pk).update(created_at=old)
    with caplog.at_level(logging.WARNING, logger="counters.write.durable"):
        result = durable.drain_outbox(buffer, "default")
    assert (result.pushed, result.repaired) == (0, 1)
    assert "queued for repair" in caplog.text
    assert buffer.client.smembers(queue_key(buffer)) == {f"unread:{alice.pk}".encode()}
    assert Outbox.objects.count() == 0
    counters.flush()  # rebuilds the queued key from the truth
    assert buffer.client.scard(queue_key(buffer)) == 0
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 2
    assert_exact(alice)


def test_a_stale_push_refusal_queues_the_row_for_repair(make_user, dead_writer, monkeypatch):
    from counters.base.exceptions import StalePush

    alice = make_user()
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
    past_grace()

    def refuse(self, deltas, push_id):
        raise StalePush(push_id)

    with monkeypatch.context() as m:
        m.setattr(Buffer, "push", refuse)
        result = durable.drain_outbox(get_buffer(), "default")
    assert (result.pushed, result.repaired) == (0, 1)
    counters.flush()
    assert_exact(alice)


def test_the_audit_and_the_rebuild_count_a_pending_row_as_buffered(make_user, dead_writer):
    users = [make_user() for _ in range(3)]
    for user in users:
        Notification.objects.create(recipient=user, verb="flushed")
    counters.flush()
    victim = users[1]
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=victim, verb="its writer died")
    assert UnreadCounter.objects.get_count(victim) == truth(victim) - 1
    assert Outbox.objects.count() == 1
    # A whole sweep of the audit, then a rebuild: neither sees drift (the row is buffered).
    results = [audit(names=["unread"], slice_size=2, confirm_delay=0.05)]
    while not results[-1].counters[0].sweep_done:
        results.append(audit(names=["unread"], slice_size=2, confirm_delay=0.05))
    assert sum(r.repaired for r in results) == 0
    assert AuditRepair.objects.count() == 0
    report = rebuild("unread", confirm_delay=0.05)
    assert (report.wrong, report.repaired) == ([], 0)
    # Had either "repaired" it, the re-push would now count it twice.
    past_grace()
    counters.flush()
    assert stored(victim) == truth(victim) == 2
    assert_exact(*users)


def test_without_the_outbox_the_audit_would_repair_it(make_user, dead_writer):
    """The test above can fail: the same dead writer without its row is repaired by the audit."""
    victim = make_user()
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=victim, verb="its writer died")
    Outbox.objects.all().delete()
    report = rebuild("unread", confirm_delay=0.05)
    assert report.repaired == 1
    assert_exact(victim)


def test_status_and_metrics_show_the_outbox(make_user, dead_writer, settings, client):
    from django.core.management import call_command

    settings.COUNTERS_METRICS = True
    alice = make_user()
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
    time.sleep(0.3)
    rows, age = outbox.stats("default")
    assert rows == 1 and age >= 0.3
    import io

    out = io.StringIO()
    call_command("counters_status", stdout=out)
    assert "outbox: 1 rows, oldest " in out.getvalue()
    assert "mode durable" in out.getvalue()
    text = client.get("/metrics").content.decode()
    assert 'tally_outbox_rows{database="default"} 1.0' in text
    line = next(
        x
        for x in text.splitlines()
        if x.startswith('tally_outbox_oldest_age_seconds{database="default"}')
    )
    assert float(line.split()[-1]) >= 0.3
    past_grace()
    counters.flush()
    text = client.get("/metrics").content.decode()
    assert 'tally_outbox_rows{database="default"} 0.0' in text
    assert 'tally_outbox_pushed_total{database="default"} ' in text


def test_a_manual_transaction_keeps_its_row_until_the_push(make_user):
    alice = make_user()
    transaction.set_autocommit(False)
    try:
        Notification.objects.create(recipient=alice, verb="manual")
        transaction.commit()
        assert Outbox.objects.count() == 0
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert_exact(alice)


def test_a_commit_slower_than_the_grace_claims_its_row_before_pushing(
    settings, make_user, monkeypatch
):
    settings.COUNTERS_OUTBOX_GRACE = 1e-6  # every commit is "late"
    alice = make_user()
    late: list[str] = []
    real_push_late = durable.push_late

    def spy(push_id, using, seconds):
        late.append(push_id)
        real_push_late(push_id, using, seconds)

    monkeypatch.setattr(durable, "push_late", spy)
    with transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
    transaction.set_autocommit(False)
    try:
        Notification.objects.create(recipient=alice, verb="manual")
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    Notification.objects.create(recipient=alice, verb="autocommit")  # not late: no transaction
    assert len(late) == 2
    assert Outbox.objects.count() == 0
    assert_exact(alice)


def test_a_late_writer_does_not_push_what_a_flush_pushed_long_ago(settings, make_user, monkeypatch):
    settings.COUNTERS_OUTBOX_GRACE = 1e-6
    alice = make_user()
    buffer = get_buffer()
    real_push_late = durable.push_late
    outcomes: list[int] = []

    def flush_first(push_id, using, seconds):
        # A flush pushes the row meanwhile, and Redis forgets the push id since.
        outcomes.append(durable.drain_outbox(buffer, using, grace=0).pushed)
        marks = buffer.client.keys(f"{buffer.prefix}:*:w:{push_id.split(':')[0]}")
        assert marks
        buffer.client.delete(*marks)
        real_push_late(push_id, using, seconds)
        outcomes.append("late")

    monkeypatch.setattr(durable, "push_late", flush_first)
    with transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
    assert outcomes == [1, "late"]
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 1  # not 2
    assert_exact(alice)


def exact_value(key) -> int:
    return sum(counters.get_parts("unread", [key])[key])


@pytest.mark.parametrize("redis_up", [True, False], ids=["redis-up", "redis-down"])
def test_a_delta_beyond_exact_scores_is_written_directly_once(settings, make_user, redis_up):
    alice, bob = make_user(), make_user()
    if not redis_up:
        settings.COUNTERS_REDIS_URL = "redis://127.0.0.1:1/0"
        settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    with transaction.atomic():
        counters.add("unread", alice.pk, 2**60)
        counters.add("unread", bob.pk, 5)
    assert Outbox.objects.count() == 0
    fallbacks = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK)
    # Up: the huge delta alone goes to the DB. Down: one direct write of both, row deleted.
    assert list(fallbacks.values_list("keys", flat=True)) == [1 if redis_up else 2]
    if not redis_up:  # everything is in the rows already
        assert (stored(alice), stored(bob)) == (2**60, 5)
        return
    assert exact_value(alice.pk) == 2**60
    assert exact_value(bob.pk) == 5
    past_grace()
    counters.flush()
    assert UnreadCounter.objects.get(user=alice).count == 2**60
    assert UnreadCounter.objects.get(user=bob).count == 5
