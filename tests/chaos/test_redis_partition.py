"""A network partition between a writer and Redis: the push is late, not lost.

The write path pushes deltas after COMMIT; if both attempts time out it
writes them to the DB instead (``counters.write.delivery.send`` → ``write_direct``). A
timeout does not mean the push did not happen: a pipeline already written to
the socket can still reach Redis after the client gave up (TCP delivers what
it sent once a partition heals; a stalled Redis runs what it read when it
resumes). Then the same deltas are counted twice, once by the DB write and
once by the next flush. A proxy that holds the pushes of one writer and
delivers them after its fallback reproduces it: the flush must fence the late
push, or take it back when it already landed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

import counters
from counters.write import fallback
from notifications.models import Notification
from tests.helpers import stored, truth
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.django_db(transaction=True)]


class PartitionProxy:
    """A TCP proxy to Redis that can hold a client's commands and deliver them later."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.lock = threading.Lock()
        self.marker: bytes | None = None
        self.held: list[tuple[socket.socket, bytes]] = []
        self.holding: set[socket.socket] = set()
        self.released = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, marker: bytes) -> None:
        """From now on hold every command chunk that contains ``marker`` (and what follows it)."""
        self.marker = marker

    def release(self) -> None:
        """The partition heals: deliver what was held, in order."""
        with self.lock:
            self.marker = None
            for upstream, data in self.held:
                with contextlib.suppress(OSError):
                    upstream.sendall(data)
            self.held.clear()
            self.holding.clear()
        self.released.set()

    def close(self) -> None:
        self.release()
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:  # Redis stopped at teardown, as this client came in
                client.close()
                continue
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            with self.lock:
                if from_client and (dst in self.holding or (self.marker and self.marker in data)):
                    self.holding.add(dst)
                    self.held.append((dst, data))
                    continue
            try:
                dst.sendall(data)
            except OSError:
                break
        if from_client and dst in self.holding:
            self.released.wait(10)  # the client hung up; its data is still on the way
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@pytest.fixture
def partition(settings) -> Iterator[PartitionProxy]:
    server = RedisServer().start()
    proxy = PartitionProxy(server.port)
    settings.COUNTERS_REDIS_URL = proxy.url
    settings.COUNTERS_SOCKET_TIMEOUT = 0.3
    try:
        yield proxy
    finally:
        proxy.close()
        server.stop()


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_push_that_arrives_after_the_fallback_is_not_counted_twice(partition, make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")  # connection up, scripts loaded
    fallbacks = fallback.fallback_count

    partition.hold(b"EVALSHA")  # the pushes of the next write stay on the wire
    Notification.objects.create(recipient=alice, verb="during the partition")
    if fallback.fallback_count != fallbacks + 1:
        pytest.fail("the push should have timed out twice and fallen back to the DB")

    partition.release()
    time.sleep(0.3)
    counters.flush()
    assert (stored(alice), truth(alice)) == (2, 2)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_push_fenced_before_it_arrives_never_applies(partition, make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="before")
    partition.hold(b"EVALSHA")
    Notification.objects.create(recipient=alice, verb="during the partition")
    assert stored(alice) == 1  # the direct write
    partition.marker = None  # new commands pass; the held ones stay held
    result = counters.flush()  # fences the held push
    assert result.compensated == 0
    partition.release()  # the late push arrives and is refused
    time.sleep(0.3)
    counters.flush()
    assert (stored(alice), truth(alice)) == (2, 2)
    assert counters.get_value("unread", alice.pk) == 2
