"""A Redis on a Unix socket as the buffer (``unix://<path>``): counted writes pushed over
the socket, on the thread's line (deferred acknowledgement), by redis-py (each push
waited on) and by the sender thread, then flushed; every value exact against the
database. The server listens on the socket alone (no TCP port), so whatever reaches
it came over the socket."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from django.db import transaction

import counters
from counters.buffer.connections import UnixConnection
from counters.models import FlushBatch
from counters.write import acks, replies
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, in_redis, stored, truth
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


@pytest.fixture
def unix_redis(settings):
    """A redis-server of this test on a Unix socket alone, the buffer of the test."""
    folder = Path(tempfile.mkdtemp(prefix="tally-"))  # a socket's path is at most 107 bytes
    try:
        with RedisServer(unix_socket=folder / "redis.sock") as server:
            settings.COUNTERS_REDIS_URL = server.url
            yield server
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def fallbacks() -> int:
    return FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count()


def pending_on_the_server(server: RedisServer, user) -> int:
    """The user's pending delta as a plain client of the socket reads it."""
    buffer = counters.get_buffer()
    member = f"unread:{user.pk}"
    client = server.client()
    try:
        score = client.zscore(buffer.key(buffer.shard_of(member), "pending"), member)
    finally:
        client.close()
    return int(score or 0)


def write(alice, bob) -> None:
    """Counted writes of every kind: inserts, an update in a transaction, a delete."""
    for i in range(5):
        Notification.objects.create(recipient=alice, verb=f"a{i}")
    for i in range(3):
        Notification.objects.create(recipient=bob, verb=f"b{i}")
    with transaction.atomic():
        first_two = Notification.objects.filter(recipient=alice).order_by("pk")[:2]
        Notification.objects.filter(pk__in=list(first_two.values_list("pk", flat=True))).update(
            is_read=True
        )
    Notification.objects.filter(recipient=bob).order_by("pk").first().delete()


def test_the_buffer_client_connects_over_the_socket(unix_redis):
    client = counters.get_client()
    assert client.connection_pool.connection_class is UnixConnection
    assert client.ping() is True


@pytest.fixture
def deferred(settings, monkeypatch):
    """Acknowledgements deferred (the default), in a process state of this test's own; replies
    read when asked, so the pushes are seen waiting on the line."""
    monkeypatch.setattr(acks, "_state", acks._State())
    monkeypatch.setattr(replies, "ACK_AFTER", 3600.0)
    settings.COUNTERS_DEFER_ACKS = True
    yield
    acks.acknowledge()


@pytest.mark.usefixtures("deferred")
@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_pushes_on_the_line_go_over_the_socket_and_flush_exactly(unix_redis, make_user):
    alice, bob = make_user(), make_user()
    write(alice, bob)
    (line,) = acks._lines()
    assert isinstance(line.line.connection, UnixConnection)
    assert len(line.waiting) > 0  # written on the line, their replies not read yet
    acks.acknowledge()
    assert not line.waiting
    assert (truth(alice), truth(bob)) == (3, 2)
    for user in (alice, bob):
        assert pending_on_the_server(unix_redis, user) == in_redis(user) == truth(user)
        assert stored(user) == 0
    assert fallbacks() == 0
    counters.flush()
    for user in (alice, bob):
        assert stored(user) == truth(user)
        assert pending_on_the_server(unix_redis, user) == in_redis(user) == 0
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 3, bob.pk: 2}
    assert_exact(alice, bob)


@pytest.mark.parametrize(
    "options",
    [
        {"COUNTERS_DEFER_ACKS": False},
        {"COUNTERS_DEFER_ACKS": False, "COUNTERS_SEND_DELAY_MS": 5.0},
    ],
    ids=["waited", "sender"],
)
def test_pushes_by_redis_py_go_over_the_socket_and_flush_exactly(
    unix_redis, make_user, settings, options
):
    for name, value in options.items():
        setattr(settings, name, value)
    alice, bob = make_user(), make_user()
    write(alice, bob)
    assert UnreadCounter.objects.get_counts([alice, bob]) == {alice.pk: 3, bob.pk: 2}
    counters.drain_queues()  # the sender's queue pushed now (a read adds it, unpushed)
    for user in (alice, bob):
        assert pending_on_the_server(unix_redis, user) == in_redis(user) == truth(user)
    assert fallbacks() == 0
    counters.flush()
    for user in (alice, bob):
        assert stored(user) == truth(user)
        assert pending_on_the_server(unix_redis, user) == 0
    assert_exact(alice, bob)
