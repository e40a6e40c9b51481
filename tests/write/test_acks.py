"""Deferred acknowledgements (COUNTERS_DEFER_ACKS, the default): pushes written at COMMIT in a
request and in batches elsewhere, their replies read later; every failure completed as a push
waited on would be.

The rest of the suite runs with the setting off (tests/settings.py), because its fault
injections patch the push a COMMIT waits on. Here the faults are real: a redis-server of
the test's own is stopped (SIGSTOP), killed, flushed of its scripts, or given a key of the
wrong type, with pushes written and unanswered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import DatabaseError, connections, transaction
from django.http import HttpResponse
from django.test import RequestFactory

import counters
from counters.base.exceptions import StalePush, UnexpectedScriptReply
from counters.buffer.pushids import PushId
from counters.client import get_buffer
from counters.middleware import AcknowledgeMiddleware
from counters.models import BufferLayout, FlushBatch, Outbox
from counters.write import acks, delivery, preflight, replies, sender
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, in_redis, stored, truth

# One push after each COMMIT: what these tests follow is that push (the sender would merge it).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("per_commit")]


@pytest.fixture(autouse=True)
def deferred(settings, monkeypatch):
    """Acknowledgements deferred, in a process state of this test's own."""
    monkeypatch.setattr(acks, "_state", acks._State())
    settings.COUNTERS_DEFER_ACKS = True
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    yield
    acks.acknowledge()
    for line in acks._lines():
        line.line.close()


def waiting() -> int:
    """Pushes of this process written and not yet acknowledged."""
    return sum(len(line.waiting) for line in acks._lines())


def fallbacks() -> int:
    return FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count()


@contextmanager
def refused_shard(own_redis, user) -> Iterator[None]:
    """Every push to ``user``'s shard fails (WRONGTYPE) until the block ends."""
    buffer = get_buffer()
    pending = buffer.key(buffer.shard_of(f"unread:{user.pk}"), "pending")
    client = own_redis.client()
    try:
        client.delete(pending)
        client.set(pending, "not a sorted set")
        yield
        client.delete(pending)
    finally:
        client.close()


@pytest.fixture
def unread_until_asked(monkeypatch):
    """No reply is old enough for the acknowledging thread or the next push to read it."""
    monkeypatch.setattr(replies, "ACK_AFTER", 3600.0)


@pytest.mark.usefixtures("unread_until_asked")
def test_a_commit_writes_its_push_and_the_reply_is_read_later(make_user):
    alice = make_user()
    for i in range(3):
        Notification.objects.create(recipient=alice, verb=str(i))
    assert waiting() == 3
    assert UnreadCounter.objects.get_count(alice) == truth(alice) == 3  # a read acknowledges
    assert waiting() == 0
    assert fallbacks() == 0
    assert_exact(alice)


def seen_by_others(user) -> int:
    """The user's pending delta as another process reads it: a plain client, no acknowledging."""
    member = f"unread:{user.pk}"
    buffer = get_buffer()
    raw = buffer.client.zscore(buffer.key(buffer.shard_of(member), "pending"), member)
    return int(raw or 0)


def eventually_seen(user, count: int, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while seen_by_others(user) != count:
        assert time.monotonic() < deadline, f"{seen_by_others(user)} seen, not {count}"
        time.sleep(0.005)


#: ``COUNTERS_WRITE_BATCH`` of the tests of batched writes.
BATCH = 16


@pytest.fixture
def batched(settings) -> int:
    settings.COUNTERS_WRITE_BATCH = BATCH
    return BATCH


@pytest.mark.usefixtures("unread_until_asked")
def test_each_push_is_written_at_commit_and_the_push_that_fills_the_line_reads_before_it(
    make_user,
):
    alice = make_user()
    for i in range(replies.MAX_WAITING - 1):
        Notification.objects.create(recipient=alice, verb=str(i))
        assert line_of_thread().line.queued == 0  # written as its COMMIT ended
    assert waiting() == replies.MAX_WAITING - 1
    eventually_seen(alice, replies.MAX_WAITING - 1)
    Notification.objects.create(recipient=alice, verb="full")
    assert waiting() == 1
    acks.acknowledge()
    assert in_redis(alice) == truth(alice) == replies.MAX_WAITING


@pytest.mark.usefixtures("unread_until_asked", "batched")
def test_outside_a_request_pushes_are_written_in_batches_and_read_a_batch_later(make_user):
    alice = make_user()
    for i in range(BATCH - 1):
        Notification.objects.create(recipient=alice, verb=str(i))
    line = line_of_thread()
    assert (waiting(), line.line.queued) == (BATCH - 1, BATCH - 1)
    time.sleep(0.05)
    assert seen_by_others(alice) == 0  # none written yet
    Notification.objects.create(recipient=alice, verb="fills the batch")
    assert (waiting(), line.line.queued) == (BATCH, 0)  # written, unanswered
    eventually_seen(alice, BATCH)
    for i in range(BATCH):
        Notification.objects.create(recipient=alice, verb=f"second {i}")
    # the second batch's write read the first batch's replies first
    assert (waiting(), line.line.queued) == (BATCH, 0)
    eventually_seen(alice, 2 * BATCH)
    acks.acknowledge()
    assert waiting() == 0
    assert in_redis(alice) == truth(alice) == 2 * BATCH
    assert fallbacks() == 0
    assert_exact(alice)


@pytest.mark.usefixtures("batched")
def test_the_acknowledging_thread_writes_a_push_no_commit_wrote(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="alone")
    assert line_of_thread().line.queued == 1
    eventually_seen(alice, 1, within=5.0)  # written by the thread within ACK_AFTER
    deadline = time.monotonic() + 5
    while waiting():  # and its reply read on a later round
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert (in_redis(alice), truth(alice), fallbacks()) == (1, 1, 0)


@pytest.mark.usefixtures("unread_until_asked", "batched")
def test_a_request_writes_each_push_as_it_commits(make_user):
    alice = make_user()
    seen: list[tuple[int, int]] = []

    def view(request):
        for i in range(3):
            Notification.objects.create(recipient=alice, verb=str(i))
            eventually_seen(alice, i + 1)  # no later commit was needed to write it
            seen.append((waiting(), line_of_thread().line.queued))
        return HttpResponse("ok")

    AcknowledgeMiddleware(view)(RequestFactory().get("/"))
    assert seen == [(1, 0), (2, 0), (3, 0)]
    assert waiting() == 0
    Notification.objects.create(recipient=alice, verb="after the request")
    assert line_of_thread().line.queued == 1  # batched again
    acks.acknowledge()
    assert in_redis(alice) == truth(alice) == 4


def line_of_thread() -> replies.Acks:
    (line,) = acks._lines()
    return line


@pytest.mark.usefixtures("unread_until_asked")
def test_the_pushes_waiting_on_a_line_have_a_writer_each_and_answered_writers_push_again(
    make_user,
):
    alice = make_user()
    for i in range(3):
        Notification.objects.create(recipient=alice, verb=str(i))
    line = line_of_thread()
    first = [push.push_id for push in line.waiting]
    assert len({p.writer for p in first}) == 3 and {p.seq for p in first} == {1}
    assert acks.writer_count() == 3
    acks.acknowledge()
    assert (len(line.writers), acks.writer_count()) == (3, 3)
    for i in range(3):
        Notification.objects.create(recipient=alice, verb=f"again {i}")
    again = [push.push_id for push in line.waiting]
    assert {p.writer for p in again} == {p.writer for p in first}  # no new writer
    assert {p.seq for p in again} == {2}
    acks.acknowledge()
    assert in_redis(alice) == truth(alice) == 6
    assert fallbacks() == 0


@pytest.mark.usefixtures("unread_until_asked")
def test_a_push_of_one_member_waits_with_its_plan(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="one")
    line = line_of_thread()
    (push,) = line.waiting
    assert type(push) is replies.Waiting
    assert line.line.unread[0] is push.plan  # the line holds the plan it wrote
    member = f"unread:{alice.pk}"
    assert push.deltas == {member: 1} and push.using == "default"
    assert push.push_id == PushId(push.writer.id, 1) and push.writer.seq == 1
    plan = push.plan
    assert plan.push_id == push.push_id and plan.deltas == {member: 1}
    assert plan.groups == {get_buffer().shard_of(member): [member, 1]}
    plan.check([1])  # added
    plan.check([0])  # a repeat: nothing to say
    with pytest.raises(StalePush):
        plan.check([2])  # delivered too late
    with pytest.raises(UnexpectedScriptReply):
        plan.check([7])
    acks.acknowledge()
    assert not line.waiting and line.writers == [push.writer]
    assert in_redis(alice) == truth(alice) == 1


@pytest.mark.usefixtures("unread_until_asked")
def test_a_push_of_several_members_or_of_another_kind_waits_with_its_plan(make_user):
    alice, bob = make_user(), make_user()
    buffer = get_buffer()
    pushes = [
        {f"unread:{alice.pk}": 1, f"unread:{bob.pk}": 2},
        {f"unread:{alice.pk}": 1.0},  # not an int: planned, and sent as the plan says
    ]
    for deltas in pushes:
        assert acks.send(deltas, "default", buffer, acks_complete) is True
    line = line_of_thread()
    assert [type(push) for push in line.waiting] == [replies.Waiting, replies.Waiting]
    assert [push.deltas for push in line.waiting] == pushes
    acks.acknowledge()
    assert not line.waiting
    assert [in_redis(alice), in_redis(bob)] == [2, 2]


@pytest.mark.usefixtures("unread_until_asked")
def test_the_writer_of_a_failed_push_never_pushes_again(own_redis, make_user):
    alice, bob = make_user(), make_user()
    # the first push to this new server is refused for want of its script (and pushed again)
    for verb in ("loads the script", "answered"):
        Notification.objects.create(recipient=bob, verb=verb)
        acks.acknowledge()
    line = line_of_thread()
    (answered,) = line.writers
    with refused_shard(own_redis, alice):
        Notification.objects.create(recipient=alice, verb="refused")
        (failed,) = [push.push_id for push in line.waiting]
        assert failed.writer == answered.id  # the idle writer pushed it
        acks.acknowledge()
    assert fallbacks() == 1
    assert (line.writers, acks.writer_count()) == ([], 0)  # dropped with its push
    for user in (alice, bob):
        Notification.objects.create(recipient=user, verb="after")
    assert failed.writer not in {push.push_id.writer for push in line.waiting}
    acks.acknowledge()
    assert in_redis(alice) == 1 and in_redis(bob) == 3
    counters.flush()
    assert [stored(alice), stored(bob)] == [truth(alice), truth(bob)] == [2, 3]
    assert_exact(alice, bob)


def test_a_push_the_line_cannot_take_is_waited_on_and_its_writer_kept(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="first")
    acks.acknowledge()
    line = line_of_thread()
    (writer,) = line.writers
    seq = writer.seq
    # a delta too large for a Redis score: the push is waited on (and written directly)
    big = {f"unread:{alice.pk}": 2**53}
    assert acks.send(big, "default", get_buffer(), acks_complete) is False
    assert line.writers == [writer] and writer.seq == seq + 1  # unsent; its next number follows
    assert not line.waiting


def acks_complete(*args) -> None:  # pragma: no cover - a push never written is not completed
    raise AssertionError(args)


def test_other_processes_read_the_change_once_acknowledged(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="x")
    acks.acknowledge()
    member = f"unread:{alice.pk}"
    buffer = get_buffer()
    # a plain client of the same Redis: what any other process reads
    raw = buffer.client.zscore(buffer.key(buffer.shard_of(member), "pending"), member)
    assert raw == 1.0


def test_the_acknowledging_thread_reads_replies_nobody_reads(make_user):
    alice = make_user()

    def write() -> None:
        try:
            Notification.objects.create(recipient=alice, verb="from a thread that ends")
        finally:
            connections.close_all()  # this thread's own connections

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    deadline = time.monotonic() + 10
    while acks._lines():  # read, then the line of the ended thread is closed and dropped
        assert time.monotonic() < deadline, "the acknowledging thread never read the reply"
        time.sleep(0.01)
    assert in_redis(alice) == 1
    assert fallbacks() == 0


@pytest.mark.usefixtures("unread_until_asked")
def test_a_stalled_redis_never_stalls_the_commit_and_its_late_push_counts_once(
    own_redis, make_user
):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")
    acks.acknowledge()
    own_redis.pause()
    try:
        notes = [Notification.objects.create(recipient=alice, verb=str(i)) for i in range(3)]
        assert (waiting(), fallbacks()) == (3, 0)  # no COMMIT waited for the stalled Redis
        # The COMMITs returned with their pushes written and unanswered. Reading them times
        # out: each is completed as a push that may have left, written to the DB unsettled.
        acks.acknowledge()
    finally:
        own_redis.resume()
    assert waiting() == 0
    assert fallbacks() == 3
    assert FlushBatch.objects.filter(unsettled__isnull=False).count() == 3
    assert notes[0].mark_read() is True
    # Redis now runs the three pushes it held: late deliveries of pushes already written
    # to the DB. The flush fences them: each counts once.
    assert_exact(alice)
    assert (stored(alice), truth(alice)) == (3, 3)


def test_pushes_unanswered_when_redis_dies_go_to_the_db_once(own_redis, make_user):
    alice, bob = make_user(), make_user()
    Notification.objects.create(recipient=alice, verb="before")
    counters.flush()
    own_redis.pause()
    for i in range(2):
        Notification.objects.create(recipient=alice, verb=str(i))
    Notification.objects.create(recipient=bob, verb="b")
    own_redis.kill()  # the pushes never ran
    acks.acknowledge()
    assert fallbacks() == 3
    assert stored(alice) == truth(alice) == 3  # in the rows already
    assert stored(bob) == truth(bob) == 1
    own_redis.start()  # empty: its epoch markers are gone, which the flush reports
    Notification.objects.create(recipient=bob, verb="after")
    assert_exact(alice, bob)


def test_a_push_refused_for_want_of_its_script_is_pushed_again(own_redis, make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")
    acks.acknowledge()
    client = own_redis.client()
    try:
        client.script_flush()  # a restarted Redis knows no script: NOSCRIPT
    finally:
        client.close()
    for i in range(3):
        Notification.objects.create(recipient=alice, verb=str(i))
    acks.acknowledge()
    assert in_redis(alice) == truth(alice) == 4
    assert fallbacks() == 0
    assert_exact(alice)


def test_an_error_reply_read_later_is_completed_in_the_db_and_counts_once(own_redis, make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")
    counters.flush()
    with refused_shard(own_redis, alice):
        Notification.objects.create(recipient=alice, verb="refused")
        acks.acknowledge()
        assert fallbacks() == 1
        assert stored(alice) == truth(alice) == 2  # the refused push's +1, written directly
    Notification.objects.create(recipient=alice, verb="after")
    assert_exact(alice)


@pytest.mark.usefixtures("unread_until_asked")
def test_the_middleware_returns_the_response_once_its_pushes_are_acknowledged(make_user):
    alice = make_user()

    def view(request):
        for i in range(3):
            Notification.objects.create(recipient=alice, verb=str(i))
        assert waiting() == 3
        return HttpResponse("ok")

    response = AcknowledgeMiddleware(view)(RequestFactory().get("/"))
    assert response.status_code == 200
    assert waiting() == 0
    assert in_redis(alice) == truth(alice) == 3


def test_a_process_serving_requests_without_the_middleware_waits_on_its_pushes(make_user):
    alice = make_user()
    acks.request_started()  # a request, and no middleware loaded in this process state
    Notification.objects.create(recipient=alice, verb="x")
    assert acks._lines() == []  # pushed and waited on, as with the setting off
    assert in_redis(alice) == 1


def test_a_celery_task_acknowledges_when_it_ends(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="x")
    sender.task_ended()
    assert waiting() == 0
    assert in_redis(alice) == 1


def test_with_the_setting_off_every_commit_waits(settings, make_user):
    settings.COUNTERS_DEFER_ACKS = False
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="x")
    assert acks._lines() == []
    assert in_redis(alice) == 1


@pytest.mark.usefixtures("unread_until_asked")
def test_durable_pushes_are_acknowledged_later_and_their_rows_left_to_the_flush(
    settings, make_user
):

    from counters.models import Outbox
    from counters.write import outbox

    settings.COUNTERS_DURABLE = True
    alice, bob = make_user(), make_user()
    for i in range(2):
        Notification.objects.create(recipient=alice, verb=str(i))
    with transaction.atomic():
        Notification.objects.create(recipient=bob, verb="in a transaction")
    assert waiting() == 3  # no COMMIT waited for its reply
    assert Outbox.objects.count() == 3
    acks.acknowledge()
    members = [f"unread:{alice.pk}", f"unread:{bob.pk}"]
    assert outbox.held(members, "default") == outbox.Held()  # every push applied
    assert in_redis(alice) == truth(alice) == 2
    counters.flush()
    assert Outbox.objects.count() == 0
    assert fallbacks() == 0
    assert_exact(alice, bob)


def test_a_durable_push_whose_reply_fails_is_written_directly_with_its_row(
    settings, own_redis, make_user
):
    from counters.models import Outbox

    settings.COUNTERS_DURABLE = True
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")
    counters.flush()
    assert Outbox.objects.count() == 0
    with refused_shard(own_redis, alice):
        Notification.objects.create(recipient=alice, verb="refused")
        assert Outbox.objects.count() == 1
        acks.acknowledge()
        assert fallbacks() == 1
        assert Outbox.objects.count() == 0  # deleted by the direct write
        assert stored(alice) == truth(alice) == 2
    Notification.objects.create(recipient=alice, verb="after")
    assert_exact(alice)


# -- a thread's pushes, and what decides each -------------------------------------------


@pytest.mark.usefixtures("unread_until_asked")
def test_a_threads_pushes_go_on_its_one_line(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="first")
    line = line_of_thread()
    for i in range(3):
        Notification.objects.create(recipient=alice, verb=str(i))
    assert line_of_thread() is line
    assert waiting() == 4  # written on the line, their replies unread
    acks.acknowledge()
    assert in_redis(alice) == truth(alice) == 4
    assert fallbacks() == 0
    assert_exact(alice)


@pytest.mark.usefixtures("unread_until_asked")
def test_durable_mode_holds_the_next_change_after_deltas_sent_without_a_push_id(
    make_user, settings
):
    """Deltas sent in durable mode without a push id of their own (as the on_commit
    callback of a transaction that never COMMITs sends them): the next change made with
    autocommit on still has its outbox row."""
    settings.COUNTERS_DURABLE = True
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="held")
    assert Outbox.objects.count() == 1
    for delta in (1, -1):  # no push id of their own, adding nothing together
        delivery.send({f"unread:{alice.pk}": delta}, "default")
    Notification.objects.create(recipient=alice, verb="held too")
    assert Outbox.objects.count() == 2
    acks.acknowledge()
    counters.flush()
    assert Outbox.objects.count() == 0
    assert stored(alice) == truth(alice) == 2
    assert_exact(alice)


@pytest.mark.usefixtures("unread_until_asked")
def test_a_changed_setting_decides_the_next_push(make_user, settings):
    """Durable mode turned on after a push on the line: the next push is held in an
    outbox row, as the setting says."""
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")
    assert waiting() == 1
    settings.COUNTERS_DURABLE = True
    Notification.objects.create(recipient=alice, verb="durable")
    assert Outbox.objects.count() == 1
    acks.acknowledge()
    counters.flush()
    assert Outbox.objects.count() == 0
    assert stored(alice) == truth(alice) == 2
    assert_exact(alice)


@pytest.mark.usefixtures("unread_until_asked")
def test_acknowledgements_turned_off_wait_on_the_next_push(make_user, settings):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="deferred")
    assert waiting() == 1
    settings.COUNTERS_DEFER_ACKS = False
    Notification.objects.create(recipient=alice, verb="waited")
    assert waiting() == 1  # the second push was waited on, not left on the line
    acks.acknowledge()
    assert in_redis(alice) == truth(alice) == 2
    assert_exact(alice)


@pytest.mark.usefixtures("unread_until_asked")
def test_after_a_request_served_without_the_middleware_every_push_is_waited_on(make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="deferred")

    def other_thread() -> None:
        Notification.objects.create(recipient=alice, verb="in another thread")
        connections.close_all()

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert waiting() == 2
    acks.request_started()  # a request with no AcknowledgeMiddleware: waits on its pushes
    assert waiting() == 0
    Notification.objects.create(recipient=alice, verb="waited")
    assert waiting() == 0
    assert in_redis(alice) == truth(alice) == 3
    assert_exact(alice)


@pytest.mark.usefixtures("unread_until_asked")
def test_each_push_records_the_buffer_layout_until_it_is_recorded(make_user, monkeypatch):
    """A layout the database could not record: each push records it again until it is."""
    locked = True
    record_layout = preflight.record_layout

    def record_unless_locked(buffer, using):
        if locked:
            raise DatabaseError("the layout table is locked")
        record_layout(buffer, using)

    monkeypatch.setattr(preflight, "_recorded", {})
    monkeypatch.setattr(preflight, "record_layout", record_unless_locked)
    BufferLayout.objects.all().delete()
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="unrecorded")
    assert waiting() == 1  # pushed all the same
    assert not BufferLayout.objects.exists()
    locked = False
    Notification.objects.create(recipient=alice, verb="recorded")
    assert BufferLayout.objects.filter(prefix=get_buffer().prefix).exists()
    acks.acknowledge()
    assert in_redis(alice) == truth(alice) == 2
    assert_exact(alice)
