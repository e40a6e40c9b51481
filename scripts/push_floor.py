"""What sending the push costs a writer, apart from Tally's own Python.

One writer process inserts notifications for one user (``off``'s insert:
counting paused) and then writes one command to Redis on a socket of its own,
reading the replies 16 at a time as the write path does. Per mode, the
median of ``--rounds`` interleaved rounds of the writer's CPU time per insert
(``time.process_time``), and the difference to ``off``:

- ``off``: the insert alone;
- ``incr``: then ``INCR <key>`` (the ``floor`` mode of ``counters_bench``);
- ``evalsha_noop``: then an ``EVALSHA`` of a script that returns 1, with the
  keys and arguments of a push (the same bytes on the wire, no work in Redis);
- ``evalsha_push``: then the push script itself, with its keys and arguments,
  under a new sequence number each time (the work Redis does for a push);
- ``hook_push``: the same command sent by a ``post_save`` receiver, as the
  least a program could do that sees each save and pushes it exactly once;
- ``tally``: ``Notification.objects.create()`` with the defaults.

So ``hook_push - off`` is the floor of what a counted insert adds with the
push's guarantees (idempotent, ordered, fenced), and ``tally - hook_push`` is
what Tally's own work adds to it::

    redis-server --port 6393 --save '' --appendonly no --bind 127.0.0.1 &
    DEBUG=0 DATABASE_URL=postgres://postgres@127.0.0.1:5432/tally_bench \\
        python scripts/push_floor.py --redis-url redis://127.0.0.1:6393/0
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Replies read at once, as ``counters.write.replies.MAX_WAITING``.
WINDOW = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inserts", type=int, default=500, help="inserts per mode and round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    args = parser.parse_args()

    os.environ["COUNTERS_REDIS_URL"] = args.redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import redis
    from django.contrib.auth import get_user_model
    from django.db.models.signals import post_save
    from hiredis import pack_command as pack

    import counters
    from benchmarks.internals import PUSH_MARKER_TTL_MS, PUSH_MAX_AGE_MS
    from benchmarks.writers import operations, set_mode
    from notifications.models import Notification

    client = redis.Redis.from_url(args.redis_url)
    address = client.connection_pool.connection_kwargs
    sock = socket.create_connection((address.get("host", "127.0.0.1"), address.get("port", 6379)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    user, _ = get_user_model().objects.get_or_create(username="write-cost")
    ops = operations()
    set_mode("tally", 0)
    off = ops["off"]
    push_sha = counters.get_buffer()._push.sha
    noop_sha = client.script_load("return 1")
    keys = [
        "push-floor:{s1}:pending",
        "push-floor:{s1}:w:floor",
        "push-floor:{s1}:since",
        "push-floor:{s1}:suspects",
    ]
    seq = itertools.count(1)
    unread = 0

    def read_replies() -> None:
        nonlocal unread
        seen = 0
        while seen < unread:
            seen += sock.recv(65536).count(b"\r\n")
        unread = 0

    def send(packed: bytes) -> None:
        nonlocal unread
        sock.sendall(packed)
        unread += 1
        if unread >= WINDOW:
            read_replies()

    def script(sha: str, uid: int) -> bytes:
        now_ms = int(time.time() * 1000)
        member = f"unread_notifications:{uid}"
        ttl, age = PUSH_MARKER_TTL_MS, PUSH_MAX_AGE_MS
        return pack(("EVALSHA", sha, 4, *keys, ttl, now_ms, age, next(seq), member, 1))

    hooked = False

    def receiver(sender, instance, created, **kwargs) -> None:
        if hooked and created and not instance.is_read:
            send(script(push_sha, instance.recipient_id))

    post_save.connect(receiver, sender=Notification, weak=False)

    def hook_push(uid: int) -> None:
        nonlocal hooked
        hooked = True
        try:
            off(uid)
        finally:
            hooked = False

    def incr(uid: int) -> None:
        off(uid)
        send(pack(("INCR", f"push-floor:{uid}")))

    def evalsha_noop(uid: int) -> None:
        off(uid)
        send(script(noop_sha, uid))

    def evalsha_push(uid: int) -> None:
        off(uid)
        send(script(push_sha, uid))

    modes: dict[str, Callable[[int], None]] = {
        "off": off,
        "incr": incr,
        "evalsha_noop": evalsha_noop,
        "evalsha_push": evalsha_push,
        "hook_push": hook_push,
        "tally": ops["tally"],
    }
    names = list(modes)
    spent: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            op = modes[name]
            for _ in range(20):  # warm up
                op(user.pk)
            read_replies()
            counters.push_queued()
            before = time.process_time()
            for _ in range(args.inserts):
                op(user.pk)
            read_replies()
            counters.push_queued()
            spent[name].append((time.process_time() - before) / args.inserts * 1e6)
        if round_ % 5 == 4:
            counters.flush()
    post_save.disconnect(receiver, sender=Notification)
    client.delete(*keys)
    Notification.objects.filter(recipient=user).delete()
    counters.flush()
    base = statistics.median(spent["off"])
    print(f"one writer, {args.inserts} inserts x {args.rounds} rounds, writer CPU µs per insert")
    print(f"{'mode':<14} {'writer':>7} {'- off':>7}")
    for name in names:
        median = statistics.median(spent[name])
        print(f"{name:<14} {median:>7.1f} {median - base:>+7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
