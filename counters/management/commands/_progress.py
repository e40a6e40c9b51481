"""Progress of a long command on a terminal: a bar on stderr, redrawn in place.

``counters_rebuild`` also logs a line every 10% when stderr is not a terminal;
``counters_audit`` and ``counters_flush`` show the bar on a terminal only (and
never with ``--json``), so cron mail and pipes get their one summary line.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import suppress

from django.core.management.base import OutputWrapper
from redis import RedisError

from counters.buffer.store import Buffer

#: Seconds between two readings of the backlog while a flush runs.
WATCH_EVERY = 0.25


class Progress:
    """A bar on a terminal; elsewhere a line every 10% (``lines``) or nothing."""

    def __init__(
        self, stream: OutputWrapper, tty: bool, *, noun: str = "counters", lines: bool = True
    ):
        self.stream = stream
        self.tty = tty
        self.noun = noun
        self.lines = lines
        self.next_step = 0.1
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        if self.tty:
            filled = int(fraction * 30)
            self._write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {self.noun}")
            self.stream.flush()
            self.drawn = True
        elif self.lines and (fraction >= self.next_step or done == total):
            self._write(f"checked {done}/{total} {self.noun} ({fraction:.0%})\n")
            self.stream.flush()
            while self.next_step <= fraction:
                self.next_step += 0.1

    def close(self) -> None:
        if self.tty and self.drawn:
            self._write("\n")

    def _write(self, text: str) -> None:
        """``text`` as it is: no line ending added, not styled as an error."""
        self.stream.write(text, style_func=_plain, ending="")


def _plain(text: str) -> str:
    return text


def backlog(buffers: Iterable[Buffer]) -> int:
    """Members pending or in flight in every shard of ``buffers``: what a flush has to apply."""
    total = 0
    for buffer in buffers:
        pipe = buffer.client.pipeline(transaction=False)
        for shard in range(buffer.shards):
            pipe.zcard(buffer.key(shard, "pending"))
            pipe.zcard(buffer.key(shard, "inflight"))
        total += sum(pipe.execute())
    return total


class BacklogWatch:
    """While a flush runs: the keys applied so far of the backlog found at the start, read
    from Redis every ``WATCH_EVERY`` seconds by a thread of its own (the flush is not slowed)."""

    def __init__(self, buffers: list[Buffer], progress: Progress) -> None:
        self.buffers = buffers
        self.progress = progress
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="counters-flush-progress")
        self.start = 0

    def show(self) -> None:
        left = backlog(self.buffers)
        self.progress(max(0, self.start - left), self.start)

    def watch(self) -> None:
        while not self.stopped.wait(WATCH_EVERY):
            with suppress(RedisError):  # a bar never stops a flush: the next reading may work
                self.show()

    def __enter__(self) -> BacklogWatch:
        try:
            self.start = backlog(self.buffers)
        except RedisError:  # the flush says what is wrong with Redis, in its own words
            return self
        self.progress(0, self.start)
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.thread.is_alive():
            self.stopped.set()
            self.thread.join()
            with suppress(RedisError):
                self.show()
        self.progress.close()
