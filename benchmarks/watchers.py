"""The watcher of the ``watched`` write mode: a process subscribed to the keys written.

A live counter's push publishes each member on its own shard channel
(``<prefix>:{sN}:live:<member>``); Redis sends a message to each process subscribed
to that channel, and to no other. The ``watched`` mode has every key its writers
write watched: one process of its own (its CPU is not the writers'), subscribed to
the channel of every bench user's unread count on one connection, as a web
process's dispatcher is for the keys its streams watch, and reading every message.
It is started before each run of the mode and ended after it, outside its time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any
from zlib import crc32

from .errors import BenchError

#: Channels subscribed to per SSUBSCRIBE.
BATCH = 500
#: Seconds a watcher has to subscribe to every channel, or to end once told.
TIMEOUT = 60.0
#: The watcher: SSUBSCRIBE in batches (the end channel last), read every message until one
#: comes on the end channel, then print how many came on the others.
CODE = """\
import sys, redis
url, batch, end = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
p = redis.Redis.from_url(url).pubsub()
names = sys.stdin.read().split()
for i in range(0, len(names), batch):
    p.ssubscribe(*names[i:i + batch])
p.ssubscribe(end)
n = 0
for m in p.listen():
    if m["type"] == "smessage":
        if m["channel"] == end:
            break
        n += 1
print(n, flush=True)
"""


def channels(prefix: str, shards: int, counter: str, keys: Sequence[int]) -> list[str]:
    """The live channel of ``counter``'s member of each of ``keys`` (the buffer's shard)."""
    from .internals import live

    members = (f"{counter}:{key}" for key in keys)
    return [live.channel(prefix, crc32(m.encode()) % shards, m) for m in members]


class Watcher:
    """Start and end the watching process; ``channels`` are the keys' channels.

    :attr:`messages` counts the messages it received on them, over every start and stop.
    """

    def __init__(self, url: str, client: Any, channels: Sequence[str]) -> None:
        if not channels:
            raise ValueError("a watcher watches at least one channel")
        self.url, self.client, self.channels = url, client, list(channels)
        self.end = f"{self.channels[0].partition(':')[0]}:watcher-end:{os.getpid()}"
        self.proc: subprocess.Popen | None = None
        self.messages = 0

    def start(self) -> None:
        """Start the process and wait until Redis has every channel subscribed."""
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CODE, self.url, str(BATCH), self.end],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n".join(self.channels))
        self.proc.stdin.close()
        deadline = time.monotonic() + TIMEOUT
        while int(self.client.execute_command("PUBSUB", "SHARDNUMSUB", self.end)[1]) == 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._kill()
                raise BenchError("the watched mode's watcher did not subscribe to its channels")
            time.sleep(0.02)

    def stop(self) -> None:
        """End the process once it has read every message published before now."""
        if self.proc is None:
            return
        self.client.execute_command("SPUBLISH", self.end, "")
        try:
            self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self._kill()
            raise BenchError("the watched mode's watcher did not end") from None
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        self.proc.stdout.close()
        self.proc = None
        self.messages += int(out.split()[0])

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None

    def __enter__(self) -> Watcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self._kill()
        else:
            self.stop()
