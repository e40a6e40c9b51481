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


def test_the_row_is_written_in_the_transaction_and_deleted_by_the_flush_after_its_push(
    make_user, monkeypatch
):
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
    # The writer adds one statement, the INSERT: its rows stay after their pushes ...
    assert sorted(Outbox.objects.values_list("push_id", flat=True)) == sorted([first, second])
    counters.flush()  # ... until a flush finds both pushes applied: within the grace
    assert Outbox.objects.count() == 0
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
    # Writers leave their rows to the flush, dead or alive.
    assert rows == [{f"unread:{victim.pk}": 1}]
    behind = truth(victim) - UnreadCounter.objects.get_count(victim)
    assert behind == (1 if at == "push" else 0)
    # Within the grace: a row whose push applied goes, one never pushed is left to its writer.
    counters.flush()
    assert Outbox.objects.count() == (1 if at == "push" else 0)
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
        (row,) = Outbox.objects.all()  # committed, and pushed: the flush deletes it
        transaction.commit()
        assert get_buffer().landed([(row.deltas, row.push_id)]) == [set(row.deltas)]
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
    assert Outbox.objects.count() == 1  # the late ones claimed theirs; the last is pushed
    counters.flush()
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
    fallbacks = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK)
    # The huge delta alone goes to the DB first, taken out of the row before the push of the
    # rest; Redis down, the rest follows it in a second direct write, which deletes the row.
    assert list(fallbacks.values_list("keys", flat=True)) == ([1] if redis_up else [1, 1])
    if not redis_up:  # everything is in the rows already
        assert Outbox.objects.count() == 0
        assert (stored(alice), stored(bob)) == (2**60, 5)
        return
    assert list(Outbox.objects.values_list("deltas", flat=True)) == [{f"unread:{bob.pk}": 5}]
    assert exact_value(alice.pk) == 2**60
    assert exact_value(bob.pk) == 5
    past_grace()
    counters.flush()
    assert UnreadCounter.objects.get(user=alice).count == 2**60
    assert UnreadCounter.objects.get(user=bob).count == 5


def users_in_one_shard(make_user, count: int = 2) -> list:
    """``count`` users whose unread members fall in one shard of the buffer."""
    buffer = get_buffer()
    by_shard: dict[int, list] = {}
    while True:
        user = make_user()
        group = by_shard.setdefault(buffer.shard_of(f"unread:{user.pk}"), [])
        group.append(user)
        if len(group) == count:
            return group


def users_in_two_shards(make_user) -> list:
    buffer = get_buffer()
    first = make_user()
    while True:
        other = make_user()
        if buffer.shard_of(f"unread:{other.pk}") != buffer.shard_of(f"unread:{first.pk}"):
            return [first, other]


def test_the_flush_deletes_a_row_only_once_its_push_applied_in_every_shard(make_user, dead_writer):
    alice, bob = users_in_two_shards(make_user)
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
        Notification.objects.create(recipient=bob, verb="b")
    (row,) = Outbox.objects.all()
    assert set(row.deltas) == {f"unread:{alice.pk}", f"unread:{bob.pk}"}
    buffer = get_buffer()
    # The writer's push reached alice's shard only, then it died.
    buffer.push({f"unread:{alice.pk}": 1}, row.push_id)
    assert buffer.landed([(row.deltas, row.push_id)]) == [{f"unread:{alice.pk}"}]
    assert durable.drain_outbox(buffer, "default").cleared == 0  # within the grace
    assert Outbox.objects.count() == 1
    # Nor do the audit's readings count alice twice: the row holds bob's delta alone.
    assert outbox.held(row.deltas, "default").deltas == {f"unread:{bob.pk}": 1}
    buffer.push({f"unread:{bob.pk}": 1}, row.push_id)  # the rest of the same push
    assert buffer.landed([(row.deltas, row.push_id)]) == [set(row.deltas)]
    assert outbox.held(row.deltas, "default").deltas == {}
    assert durable.drain_outbox(buffer, "default").cleared == 1  # still within the grace
    assert Outbox.objects.count() == 0
    counters.flush()
    assert_exact(alice, bob)


def test_a_row_whose_push_applied_is_no_drift_for_the_rebuild_before_the_flush(make_user):
    users = [make_user() for _ in range(3)]
    for user in users:
        Notification.objects.create(recipient=user, verb="pushed, row kept")
    assert Outbox.objects.count() == 3  # each pushed; no flush has run
    report = rebuild("unread", confirm_delay=0.05)
    # Counting the rows as buffered too would read 2 for 1 and "repair" them.
    assert (report.wrong, report.repaired, report.unstable) == ([], 0, [])
    counters.flush()
    assert Outbox.objects.count() == 0
    assert_exact(*users)


def test_a_row_too_old_to_tell_proves_nothing_to_the_rebuild(make_user, dead_writer):
    alice = make_user()
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
    old = timezone.now() - timedelta(seconds=outbox.OUTBOX_SAFE_AGE + 5)
    Outbox.objects.update(created_at=old)
    assert outbox.held([f"unread:{alice.pk}"], "default").unknown == {f"unread:{alice.pk}"}
    report = rebuild("unread", confirm_delay=0.01)
    assert (report.wrong, report.repaired, report.unstable) == ([], 0, [alice.pk])
    counters.flush()  # the flush queues it for repair and rebuilds it from the truth
    # (The repair's own row, pushed, waits for the next flush.)
    assert outbox.held([f"unread:{alice.pk}"], "default") == outbox.Held()
    counters.flush()
    assert Outbox.objects.count() == 0
    assert stored(alice) == truth(alice) == 1
    assert_exact(alice)


def test_a_sum_beyond_exact_scores_leaves_the_row_before_the_rest_is_pushed(
    settings, make_user, monkeypatch
):
    alice, bob = users_in_one_shard(make_user)
    near = 2**53 - 3
    with transaction.atomic():
        counters.add("unread", alice.pk, near)  # in Redis, just below the limit
    counters.flush()
    with transaction.atomic():
        counters.add("unread", alice.pk, near)  # pending again: the next +5 cannot fit
    events: list[tuple[str, dict]] = []
    real_push, real_update = Buffer.push, outbox.update

    def push(self, deltas, push_id):
        events.append(("push", dict(deltas)))
        return real_push(self, deltas, push_id)

    def update(push_id, deltas, using):
        events.append(("row", dict(deltas)))
        return real_update(push_id, deltas, using)

    monkeypatch.setattr(Buffer, "push", push)
    monkeypatch.setattr(outbox, "update", update)
    with transaction.atomic():
        counters.add("unread", alice.pk, 5)
        counters.add("unread", bob.pk, 7)
    a, b = f"unread:{alice.pk}", f"unread:{bob.pk}"
    # Their shard refused the first push whole; alice's +5 went to the DB, out of the row,
    # before the repeat that completes the push (and would let a flush delete the row).
    assert events == [("push", {a: 5, b: 7}), ("row", {b: 7}), ("push", {b: 7})]
    rows = list(Outbox.objects.values_list("deltas", flat=True))
    assert {b: 7} in rows and {a: 5, b: 7} not in rows
    fallbacks = FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK)
    assert list(fallbacks.values_list("keys", "deltas")) == [(1, 5)]
    assert exact_value(alice.pk) == 2 * near + 5
    assert exact_value(bob.pk) == 7
    counters.flush()
    assert Outbox.objects.count() == 0
    assert UnreadCounter.objects.get(user=bob).count == 7


def test_the_flush_deletes_every_applied_row_page_by_page(make_user, dead_writer):
    users = [make_user() for _ in range(5)]
    for user in users[:2]:
        Notification.objects.create(recipient=user, verb="pushed")
    with dead_writer, transaction.atomic():
        Notification.objects.create(recipient=users[0], verb="never pushed")
    for user in users[2:]:
        Notification.objects.create(recipient=user, verb="pushed")
    assert Outbox.objects.count() == 6
    # Two rows a page: past the row that stays (the third oldest), every applied row goes.
    assert outbox.clear_landed(get_buffer(), "default", limit=2) == 5
    assert Outbox.objects.count() == 1
    past_grace()
    counters.flush()
    assert Outbox.objects.count() == 0
    assert_exact(*users)


def test_applied_rows_go_and_hold_nothing_on_every_backend(redis_backend, make_user):
    alice, bob = users_in_two_shards(make_user)
    with transaction.atomic():
        Notification.objects.create(recipient=alice, verb="a")
        Notification.objects.create(recipient=bob, verb="b")
    (row,) = Outbox.objects.all()
    # One read of both shards' marks (on a cluster, of the masters that hold them).
    assert get_buffer().landed([(row.deltas, row.push_id)]) == [set(row.deltas)]
    assert outbox.held(row.deltas, "default") == outbox.Held()
    counters.flush()
    assert Outbox.objects.count() == 0
    assert_exact(alice, bob)


def test_a_push_the_flush_counted_after_its_drain_leaves_no_row_behind(make_user, monkeypatch):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="pushed after the drain")
    assert Outbox.objects.count() == 1
    # The drain at the start of the flush runs before this push applies ...
    monkeypatch.setattr("counters.ops.run.drain_outbox", lambda *args, **kwargs: None)
    counters.flush()
    # ... and the flush moves and counts it: its row goes with that flush, not the next one.
    assert stored(alice) == truth(alice) == 1
    assert Outbox.objects.count() == 0
    assert_exact(alice)


def test_each_part_of_a_parallel_flush_leaves_no_row_of_what_it_counted(
    settings, make_user, monkeypatch
):
    from config.celery import app
    from counters import tasks

    settings.COUNTERS_FLUSH_PARALLELISM = 4
    users = [make_user() for _ in range(12)]
    for user in users:
        Notification.objects.create(recipient=user, verb="pushed after the drain")
    assert Outbox.objects.count() == 12
    monkeypatch.setattr("counters.ops.fanout.drain_outbox", lambda *args, **kwargs: None)
    eager = app.conf.task_always_eager
    app.conf.task_always_eager = True  # the parts run inline
    try:
        tasks.flush_counters()  # four parts, each clearing the rows it counted
    finally:
        app.conf.task_always_eager = eager
    assert Outbox.objects.count() == 0
    assert [stored(u) for u in users] == [truth(u) for u in users] == [1] * 12
    assert_exact(*users)
