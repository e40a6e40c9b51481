"""Redis unreachable while writing: deltas go straight to the DB; nothing is lost."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

import counters
from counters.base.exceptions import BufferUnavailable, NotConnected, StalePush
from counters.models import FlushBatch
from counters.write import delivery, fallback
from notifications.models import Notification, UnreadCounter
from tests.helpers import assert_exact, stored, truth

# One push after each COMMIT: what these tests follow is that push (the sender would merge it).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("per_commit")]


@pytest.fixture(autouse=True)
def short_timeouts(settings):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5


def test_writes_while_redis_is_killed_fall_back_to_the_db(own_redis, settings, make_user):
    alice, bob = make_user(), make_user()
    first = Notification.objects.create(recipient=alice, verb="before")
    Notification.objects.create(recipient=bob, verb="before")
    assert UnreadCounter.objects.get_count(alice) == 1
    counters.flush()
    Notification.objects.create(recipient=alice, verb="buffered, then lost with Redis")

    own_redis.kill()
    fallbacks = fallback.fallback_count
    second = Notification.objects.create(recipient=alice, verb="during")
    Notification.objects.create(recipient=bob, verb="during")
    assert first.mark_read() is True
    assert Notification.objects.filter(recipient=bob).mark_all_read() == 2
    second.delete()
    assert fallback.fallback_count - fallbacks == 5
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count() == 5
    # every change made while Redis was down is in the rows already
    assert stored(bob) == truth(bob) == 0

    own_redis.start()  # back, empty: the one delta buffered before the kill is gone
    assert stored(alice) == truth(alice) - 1
    UnreadCounter.objects.filter(user=alice).update(count=truth(alice))  # what a rebuild does
    Notification.objects.create(recipient=alice, verb="after")
    assert_exact(alice, bob)


def test_unreachable_redis_url_never_fails_the_write(settings, make_user):
    settings.COUNTERS_REDIS_URL = "redis://127.0.0.1:1/0"
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    alice = make_user()
    notes = [Notification.objects.create(recipient=alice, verb=str(i)) for i in range(3)]
    assert notes[0].mark_read() is True
    assert stored(alice) == truth(alice) == 2
    # reads degrade to the rows, which hold every change made while Redis is down
    assert UnreadCounter.objects.get_count(alice) == 2
    with pytest.raises(BufferUnavailable) as info:
        counters.flush()
    assert info.value.url == "redis://127.0.0.1:1/0"


def _resp_command(data: bytes) -> tuple[bytes, bytes] | None:
    """(command name, the rest) of the first complete RESP command in ``data``, if any."""
    head, sep, rest = data.partition(b"\r\n")
    if not sep:
        return None
    args = []
    for _ in range(int(head[1:])):
        length, sep, rest = rest.partition(b"\r\n")
        if not sep or len(rest) < int(length[1:]) + 2:
            return None
        args.append(rest[: int(length[1:])])
        rest = rest[int(length[1:]) + 2 :]
    return args[0].upper(), rest


@pytest.fixture
def silent_server(redis_client):
    """A proxy to the test Redis that stalls a connection at its first GET or EVALSHA.

    Connecting (the handshake, health-check PINGs) goes through; the stalled
    command is read and never answered, like a Redis that hung after taking it.
    """
    upstream = redis_client.connection_pool.connection_kwargs
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    sockets: list[socket.socket] = [server]

    def relay(source: socket.socket, target: socket.socket, stall: bool) -> None:
        pending, stalled = b"", False
        source.settimeout(0.1)
        while not stop.is_set():
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            if not stall:
                target.sendall(data)
                continue
            pending += data
            while not stalled and (parsed := _resp_command(pending)) is not None:
                name, rest = parsed
                if name in (b"GET", b"EVALSHA"):
                    stalled = True
                else:
                    target.sendall(pending[: len(pending) - len(rest)])
                    pending = rest

    def start(target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        threads.append(thread)

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                redis_side = socket.create_connection((upstream["host"], upstream["port"]))
                sockets.extend((conn, redis_side))
                start(relay, conn, redis_side, True)
                start(relay, redis_side, conn, False)

    start(serve)
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    stop.set()
    for thread in threads:
        thread.join()
    for sock in sockets:
        sock.close()


def test_a_refused_connection_is_not_sent(settings):
    """Connecting failed: the push certainly never left, so the direct write is settled."""
    client = counters.get_client("redis://127.0.0.1:1/0", 0.2)
    with pytest.raises(NotConnected) as info:
        client.ping()
    assert delivery.may_have_left(info.value) is False


def test_a_timeout_after_the_command_left_may_still_arrive(silent_server):
    client = counters.get_client(silent_server, 0.2)
    assert client.ping() is True
    with pytest.raises(RedisTimeoutError) as info:
        client.get("x")
    assert not isinstance(info.value, NotConnected)
    assert delivery.may_have_left(info.value) is True


@pytest.mark.parametrize(
    ("url", "unsettled"),
    [
        pytest.param("redis://127.0.0.1:1/0", False, id="refused"),
        pytest.param("silent", True, id="timed-out"),
    ],
)
def test_the_direct_write_is_unsettled_only_if_the_push_may_have_left(
    settings, make_user, silent_server, url, unsettled
):
    url = silent_server if url == "silent" else url
    settings.COUNTERS_REDIS_URL = url
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="x")
    row = FlushBatch.objects.get(kind=FlushBatch.Kind.FALLBACK)
    assert row.unsettled == ({f"unread:{alice.pk}": 1} if unsettled else None)
    assert stored(alice) == truth(alice) == 1


@pytest.mark.parametrize(
    ("exc", "left"),
    [
        pytest.param(NotConnected("Error connecting to 127.0.0.1:1"), False, id="not-connected"),
        # The message does not matter, the type does.
        pytest.param(RedisConnectionError("Error connecting (text only)"), True, id="text"),
        pytest.param(RedisConnectionError("Connection closed by server."), True, id="reset"),
        pytest.param(RedisTimeoutError("Timeout reading from socket"), True, id="timeout"),
        pytest.param(OutOfMemoryError("OOM"), True, id="oom-one-shard-of-several"),
        pytest.param(StalePush("p"), True, id="stale-one-shard-of-several"),
    ],
)
def test_may_have_left_is_decided_by_type(exc, left):
    assert delivery.may_have_left(exc) is left
