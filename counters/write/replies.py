"""A thread's lines to the buffer, and the pushes written on them waiting for their replies.

A line (:class:`Acks`, one per thread and database) writes each push handed
to it (:meth:`Acks.push`, :meth:`Acks.send`) and reads the replies later
(:meth:`Acks.settle`), when they have usually arrived: once ``MAX_WAITING``
pushes wait or the oldest is ``ACK_AFTER`` old. A push waiting is a
:class:`Waiting`. Each method returns the pushes
that failed, with their errors: their completion, and when the replies are
read besides, is :mod:`counters.write.acks`'s.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from redis.exceptions import ConnectionError as RedisConnectionError

from counters.base.exceptions import NotConnected
from counters.buffer import pushids
from counters.buffer.intake import PushPlan
from counters.buffer.line import Line
from counters.buffer.pushids import PushId, Writer
from counters.buffer.store import Buffer

#: Seconds after which the acknowledging thread reads a reply nobody else has read, and
#: within which it writes a push no commit wrote.
ACK_AFTER = 0.05
#: Pushes a line holds unanswered before its next write reads their replies (in one read).
MAX_WAITING = 16
#: The replies of a push of one shard that added its deltas.
_ADDED = [1]

#: ``complete(deltas, using, push_id, error)``: finish a push that failed with ``error``
#: (:func:`counters.write.delivery.complete`); it ends ``push_id``.
Complete = Callable[[Mapping[str, int], str, PushId, BaseException], None]


class ThreadLines(threading.local):
    """A thread's own: its lines (database alias -> :class:`Acks`), whether it serves a
    request."""

    def __init__(self) -> None:
        self.lines: dict[str, Acks] = {}
        self.serving = False


class Waiting:
    """A push written to a line, waiting for its reply.

    ``writer``: the line's own writer that pushes it (:meth:`Acks.push`), else
    None (its id was allocated from :mod:`~counters.buffer.pushids`' pool).
    """

    __slots__ = ("complete", "deltas", "plan", "push_id", "sent_at", "using", "writer")

    def __init__(
        self,
        plan: PushPlan,
        push_id: PushId,
        deltas: Mapping[str, int],
        using: str,
        complete: Complete,
        writer: Writer | None = None,
    ) -> None:
        self.plan = plan
        self.push_id = push_id
        self.deltas = deltas
        self.using = using
        self.complete = complete
        self.writer = writer
        self.sent_at = time.monotonic()


Failed = tuple[Waiting, BaseException]


class Acks:
    """One thread's line to the buffer of one database, and the pushes waiting on it.

    The line has writers of its own (:class:`~counters.buffer.pushids.Writer`),
    kept under its lock, which its sends and reads hold anyway: one per push
    waiting, each with one push in flight, as for the process's pool. A writer
    whose push is answered applied pushes again; one whose push failed is
    dropped, whatever its completion finds (a writer retired after a push that
    resolved costs only a new writer id).
    """

    def __init__(self, buffer: Buffer, using: str, thread: ThreadLines) -> None:
        self.buffer = buffer
        self.using = using
        #: The state of the thread that owns the line: whether it serves a request.
        self.thread = thread
        self.line = Line(buffer)
        self.owner = threading.current_thread()
        self.lock = threading.Lock()
        self.waiting: deque[Waiting] = deque()
        #: The line's writers with no push in flight.
        self.writers: list[Writer] = []

    def push(
        self, deltas: Mapping[str, int], complete: Complete, batch: int = 1
    ) -> list[Failed] | None:
        """Write the push of ``deltas`` under the next push id of a writer of the line, as
        :meth:`send`; None if it must be waited on instead (nothing to push, or a member
        too large for a score: :meth:`~counters.buffer.store.Buffer.plan_push`)."""
        with self.lock:
            writers = self.writers
            writer = writers.pop() if writers else Writer()
            push_id = writer.next_push_id()
            try:
                plan = self.buffer.plan_push(deltas, push_id)
            except BaseException:
                writers.append(writer)  # never sent: its next number follows this one
                raise
            if not plan.calls or plan.refused:
                writers.append(writer)
                return None
            push = Waiting(plan, push_id, deltas, self.using, complete, writer)
            return self._write(push, plan, batch)

    def send(self, push: Waiting, batch: int = 1) -> list[Failed]:
        """Hand ``push`` to the line; the failed pushes (of the replies read, if any were).

        The line writes it at once while the thread serves a request or
        ``batch`` is 1, else once ``batch`` pushes wait to be written or the
        oldest of them is ``ACK_AFTER`` old. Before it writes, the replies of
        the pushes written before are read, once ``MAX_WAITING`` are waiting
        or the oldest is ``ACK_AFTER`` old.

        ``push`` is among the failed ones if it could not be handed on (with
        :class:`~counters.base.exceptions.NotConnected` if it never left).
        """
        with self.lock:
            return self._write(push, push.plan, batch)

    def _write(self, push: Waiting, plan: PushPlan, batch: int) -> list[Failed]:
        if batch > 1 and not self.thread.serving:
            return self._take(push, plan, batch)
        waiting = self.waiting
        try:
            self.line.send(plan)
        except Exception as exc:
            return [*self._broken(exc), (push, exc)]
        waiting.append(push)
        if len(waiting) < MAX_WAITING and waiting[0].sent_at > push.sent_at - ACK_AFTER:
            return []
        return self._settle(keep=1)  # the replies before it, arrived by now: one read

    def _take(self, push: Waiting, plan: PushPlan, batch: int) -> list[Failed]:
        """:meth:`_write` of a thread that batches its writes (``batch`` above 1)."""
        line, waiting = self.line, self.waiting
        try:
            line.send(plan, now=False)
        except Exception as exc:
            return [*self._broken(exc), (push, exc)]
        waiting.append(push)
        queued = line.queued
        too_old = push.sent_at - ACK_AFTER
        if queued < batch and waiting[-queued].sent_at > too_old:
            return []
        failed: list[Failed] = []
        written = len(waiting) - queued
        if written >= MAX_WAITING or (written and waiting[0].sent_at <= too_old):
            failed = self._settle(keep=queued)  # written before: arrived by now, one read
        return self._write_queued(failed)

    def _write_queued(self, failed: list[Failed]) -> list[Failed]:
        """Write the pushes the line holds unwritten; ``failed`` and, if the line broke, all
        the pushes waiting."""
        try:
            self.line.write()
        except Exception as exc:
            failed.extend(self._broken(exc))
        return failed

    def settle(self, older_than: float | None = None) -> list[Failed]:
        """Read the replies of the pushes waiting, writing those not written yet first.

        ``older_than``: read only those written and handed on before it, then
        write the rest (the acknowledging thread's round: their replies wait
        for its next one).
        """
        with self.lock:
            if older_than is None:
                return self._settle(keep=0)
            return self._write_queued(self._settle(keep=self.line.queued, older_than=older_than))

    def _settle(self, keep: int, older_than: float | None = None) -> list[Failed]:
        failed: list[Failed] = []
        waiting, line, writers = self.waiting, self.line, self.writers
        if older_than is None and len(waiting) > keep:
            # The usual replies, arrived by now: each push of one shard added. Taken in one
            # pass; the rest (another reply, or one not arrived yet) are read one by one.
            wanted = len(waiting) - keep
            taken = line.receive_added(wanted)
            for _ in range(taken):
                push = waiting.popleft()
                if push.writer is not None:
                    writers.append(push.writer)
                else:
                    pushids.release(push.push_id)
            if taken == wanted:
                return failed
        while len(waiting) > keep:
            push = waiting[0]
            if older_than is not None and push.sent_at > older_than:
                break
            try:
                plan, replies = line.receive()
                waiting.popleft()
                if replies != _ADDED:  # not a one-shard push added: what it means
                    plan.check(replies)
            except Exception as exc:
                if waiting and waiting[0] is push:
                    waiting.popleft()
                failed.append((push, exc))
                if line.broken:  # the rest were written too, and may have run
                    failed.extend(self._broken(exc))
                continue
            if push.writer is not None:
                writers.append(push.writer)
            else:
                pushids.release(push.push_id)
        return failed

    def _broken(self, exc: BaseException) -> list[Failed]:
        """The pushes written on a line that broke, none of them answered: each may have run."""
        self.line.abandon()
        if isinstance(exc, NotConnected):  # that one never left; those before it did
            exc = RedisConnectionError(f"the line closed before their replies were read: {exc}")
        broken = [(push, exc) for push in self.waiting]
        self.waiting.clear()
        return broken

    def idle(self) -> bool:
        return not self.waiting

    def writer_count(self) -> int:
        """The line's writers: with no push in flight, and with one."""
        with self.lock:
            return len(self.writers) + sum(push.writer is not None for push in self.waiting)
