"""A bounded load test of the inbox's live stream: N open streams on one web process.

Starts one uvicorn process (``config.asgi``, as ``make run`` does) on loopback,
logs in ``--streams`` users of its own (``live-load-<i>``), opens one Server-Sent
Events stream per user, then measures:

- the memory of the web process per open stream (its resident set before the
  streams and with them all open, divided by their number);
- the Redis connections the web process holds (the server's ``CLIENT LIST``
  entries from the web process's local ports), subscribers among them and the channels
  they are subscribed to (one per watched key);
- the delay from a COMMIT to its event on the stream, per stream: one
  transaction that notifies every user at once (``--fanouts`` times; each stream
  gets its own new count), and ``--singles`` commits for one user at a time.

Everything stops by itself: the streams are closed, the server stopped and the
users deleted at the end, or after ``--timeout`` seconds::

    DEBUG=0 DATABASE_URL=postgres://postgres@127.0.0.1:5432/tally_load \\
        python scripts/live_load.py --streams 1000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "live-load-"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def local_ports(pid: int) -> set[int]:
    """The local TCP ports of the sockets process ``pid`` has open (``/proc/<pid>/net/tcp``)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def redis_clients(client, pid: int) -> tuple[int, int, int]:
    """(connections, subscribers, channels subscribed to) of process ``pid`` that the Redis
    server lists."""
    ports = local_ports(pid)
    mine = [c for c in client.client_list() if int(c["addr"].rsplit(":", 1)[1]) in ports]
    channels = [int(c.get("ssub", 0)) + int(c.get("sub", 0)) for c in mine]
    return len(mine), sum(1 for n in channels if n), sum(channels)


def setup(count: int) -> list[tuple[int, str]]:
    """``count`` users with a session each: (user id, session cookie)."""
    from django.contrib.auth import (
        BACKEND_SESSION_KEY,
        HASH_SESSION_KEY,
        SESSION_KEY,
        get_user_model,
    )
    from django.contrib.sessions.backends.db import SessionStore

    user_model = get_user_model()
    user_model.objects.filter(username__startswith=PREFIX).delete()
    users = user_model.objects.bulk_create(
        [user_model(username=f"{PREFIX}{i}") for i in range(count)]
    )
    out = []
    for user in users:
        session = SessionStore()
        session[SESSION_KEY] = str(user.pk)
        session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
        session[HASH_SESSION_KEY] = user.get_session_auth_hash()
        session.create()
        out.append((user.pk, f"sessionid={session.session_key}"))
    return out


class Stream:
    """One open stream: its reader, and the times its states arrived with their counts."""

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.states: list[tuple[float, int]] = []
        self.changed = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Future[None] | None = None

    async def open(self, port: int, cookie: str) -> None:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer.write(
            (
                "GET /api/notifications/stream/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Cookie: {cookie}\r\nAccept: text/event-stream\r\n\r\n"
            ).encode()
        )
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"stream of user {self.uid}: {status!r}")
        self.task = asyncio.ensure_future(self.read(reader))
        await self.changed.wait()

    async def read(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            if line.startswith(b"data: {"):
                unread = int(line.split(b'"unread":', 1)[1].split(b",", 1)[0])
                self.states.append((time.time(), unread))
                self.changed.set()

    async def until(self, unread: int, deadline: float) -> float | None:
        """When the stream first showed ``unread`` (None: not before ``deadline``)."""
        while True:
            for at, value in self.states:
                if value == unread:
                    return at
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                return None


def notify(uids: list[int], verb: str) -> float:
    """One transaction notifying ``uids``; the time of its COMMIT."""
    from django.db import transaction

    from notifications.models import Notification

    with transaction.atomic():
        Notification.objects.bulk_create(
            [Notification(recipient_id=uid, verb=verb) for uid in uids]
        )
    return time.time()


def summary(name: str, delays: list[float | None]) -> str:
    got = sorted(d for d in delays if d is not None)
    missed = len(delays) - len(got)
    if not got:
        return f"{name}: no event arrived ({missed} missed)"
    q = statistics.quantiles(got, n=100) if len(got) > 1 else [got[0]] * 99
    return (
        f"{name}: {len(got)} events, median {statistics.median(got) * 1000:.0f} ms, "
        f"p95 {q[94] * 1000:.0f} ms, max {got[-1] * 1000:.0f} ms, missed {missed}"
    )


async def measure(args: argparse.Namespace, web: subprocess.Popen, port: int, users) -> None:
    import redis
    from asgiref.sync import sync_to_async
    from django.conf import settings

    url = getattr(settings, "COUNTERS_REDIS_URL", None) or os.environ.get("COUNTERS_REDIS_URL")
    server = redis.Redis.from_url(url or settings.REDIS_URL)
    base_rss = rss_kib(web.pid)
    streams = [Stream(uid) for uid, _ in users]
    started = time.monotonic()
    step = args.connecting
    for i in range(0, len(streams), step):  # a few at a time, each with its first state
        batch = list(zip(streams[i : i + step], users[i : i + step], strict=True))
        await asyncio.gather(*(s.open(port, cookie) for s, (_, cookie) in batch))
    opened = time.monotonic() - started
    await asyncio.sleep(1)
    per_stream = (rss_kib(web.pid) - base_rss) / len(streams)
    connections, subscribers, channels = redis_clients(server, web.pid)
    print(f"{len(streams)} streams open in {opened:.1f} s on one web process (pid {web.pid})")
    print(f"memory: {base_rss / 1024:.0f} MiB before, {per_stream:.1f} KiB more per stream")
    print(
        f"Redis connections of the web process: {connections}, subscribers {subscribers}, "
        f"on {channels} channels (one per watched key)"
    )
    create = sync_to_async(notify, thread_sensitive=False)
    for round_ in range(1, args.fanouts + 1):
        committed = await create([s.uid for s in streams], f"fan-out {round_}")
        deadline = time.monotonic() + args.wait
        arrived = await asyncio.gather(*(s.until(round_, deadline) for s in streams))
        delays = [None if a is None else max(0.0, a - committed) for a in arrived]
        print(summary(f"fan-out {round_} (one COMMIT, {len(streams)} users)", delays))
    singles: list[float | None] = []
    for i in range(args.singles):
        stream = streams[(i * 7919) % len(streams)]
        want = stream.states[-1][1] + 1
        committed = await create([stream.uid], f"single {i}")
        at = await stream.until(want, time.monotonic() + args.wait)
        singles.append(None if at is None else max(0.0, at - committed))
    if singles:
        print(summary(f"single commits ({len(singles)}, one user each)", singles))
    for s in streams:
        if s.writer is not None:
            s.writer.close()


def start_web(port: int) -> subprocess.Popen:
    web = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "config.asgi:application",
            "--host=127.0.0.1",
            f"--port={port}",
            "--lifespan=off",
            "--no-access-log",
            "--log-level=warning",
            "--timeout-graceful-shutdown=2",
        ],
        cwd=ROOT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return web
        except OSError:
            if web.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the web process did not start") from None
            time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--fanouts", type=int, default=3, help="commits notifying every user")
    parser.add_argument("--singles", type=int, default=20, help="commits notifying one user")
    parser.add_argument("--wait", type=float, default=10.0, help="s an event may take at most")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--connecting",
        type=int,
        default=20,
        help="streams opened at once (each request reads its session: a database connection)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="s the whole run may take")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.contrib.auth import get_user_model

    import counters

    signal.alarm(int(args.timeout))  # bounded whatever happens
    users = setup(args.streams)
    web = start_web(args.port)
    try:
        asyncio.run(measure(args, web, args.port, users))
    finally:
        os.killpg(web.pid, signal.SIGTERM)
        try:
            web.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(web.pid, signal.SIGKILL)
            web.wait(30)
        get_user_model().objects.filter(username__startswith=PREFIX).delete()
        counters.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
