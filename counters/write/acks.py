"""Pushes acknowledged later: the committing thread hands its push on and does not wait.

With ``COUNTERS_DEFER_ACKS`` on (the default), :func:`send` hands a
committed push to a line of the thread's own (:class:`~counters.buffer.line.Line`)
and returns. The line writes it to Redis:

- at once while the thread serves a request
  (:class:`counters.middleware.AcknowledgeMiddleware`), as each COMMIT ends;
- otherwise (a command, a Celery task, a script) as its COMMIT ends too, or,
  with ``COUNTERS_WRITE_BATCH`` above 1, with the pushes after it in one
  system call, once that many are handed on or the oldest is ``ACK_AFTER``
  old; by the acknowledging thread within ``ACK_AFTER``; and whenever a reply
  is read (below).

Its reply is read later, when it has usually arrived already:

- by the thread's next write, once ``MAX_WAITING`` pushes wait or the
  oldest is ``ACK_AFTER`` old (one read takes them all; in batches, before
  it writes the next batch);
- before any read of a counter in this process (:func:`acknowledge`), so
  this process reads its own writes;
- before a request's response is returned
  (:class:`counters.middleware.AcknowledgeMiddleware`), and after a Celery
  task ends: other processes read the change by then;
- by this process's acknowledging thread, once a reply is ``ACK_AFTER`` old;
- when the process exits (``counters.drain_queues()`` and the exit hooks).

A push whose reply is a failure, or whose line broke before its reply was
read, is completed as a push waited on would have been: pushed again under
the same id, else written to the database directly, unsettled if it may have
applied (:mod:`counters.write.delivery`), so no path counts it twice. That
completion runs in the thread that read the reply, unless that thread is
inside a transaction of the database: then the acknowledging thread runs it,
and the reader waits for it.

A web process that serves requests without the middleware waits on its
pushes, as with ``COUNTERS_DEFER_ACKS`` off: its responses would otherwise
leave before their pushes are acknowledged.

A thread's first push of this kind keeps its route (:func:`keep_route`):
its next pushes to that database go straight to its line
(:func:`send_kept`), without the lookups that decided the first one (the
settings, the buffer, its recorded layout, the line). A changed setting or a
request served without the middleware drops every thread's route
(:func:`forget_routes`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from django.core.signals import setting_changed
from django.db import connections
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from counters.base.exceptions import NotConnected
from counters.buffer import pushids
from counters.buffer.intake import PushPlan
from counters.buffer.line import Line
from counters.buffer.pushids import PushId, Writer
from counters.buffer.store import Buffer
from counters.write import exits

logger = logging.getLogger(__name__)

#: Seconds after which the acknowledging thread reads a reply nobody else has read, and
#: within which it writes a push no commit wrote.
ACK_AFTER = 0.05
#: Pushes a line holds unanswered before its next write reads their replies (in one read).
MAX_WAITING = 16
#: Seconds a read waits for the acknowledging thread to complete failed pushes.
COMPLETE_TIMEOUT = 30.0
#: The replies of a push of one shard that added its deltas.
_ADDED = [1]

#: ``complete(deltas, using, push_id, error)``: finish a push that failed with ``error``
#: (:func:`counters.write.delivery.complete`); it ends ``push_id``.
Complete = Callable[[Mapping[str, int], str, PushId, BaseException], None]


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


class OnePush:
    """A push of one member written to a line, waiting for its reply; its own plan.

    Most pushes are one counted change of one counter. Such a push is made
    without a :class:`~counters.buffer.pushids.PushId`, a
    :class:`~counters.buffer.intake.PushPlan` and a :class:`Waiting`: it is
    what :class:`Waiting` holds, and what the line reads of a plan (its
    encoded command, and that it is one call). Its push id, its deltas and
    its plan are made when they are needed: when its reply is not 1, or it
    failed.
    """

    __slots__ = (
        "buffer",
        "complete",
        "delta",
        "member",
        "sent_at",
        "seq",
        "using",
        "wire",
        "writer",
    )

    #: What the line reads of :attr:`PushPlan.calls <counters.buffer.intake.PushPlan.calls>`:
    #: one call (its command is :attr:`wire`).
    calls = ((),)

    def __init__(
        self,
        buffer: Buffer,
        wire: bytes,
        writer: Writer,
        seq: int,
        member: str,
        delta: int,
        using: str,
        complete: Complete,
    ) -> None:
        self.buffer = buffer
        self.wire = wire
        self.writer = writer
        self.seq = seq
        self.member = member
        self.delta = delta
        self.using = using
        self.complete = complete
        self.sent_at = time.monotonic()

    @property
    def push_id(self) -> PushId:
        return self.writer.push_id(self.seq)

    @property
    def deltas(self) -> dict[str, int]:
        return {self.member: self.delta}

    @property
    def plan(self) -> PushPlan:
        return self.buffer.plan_push(self.deltas, self.push_id)

    def check(self, replies: list) -> None:
        """:meth:`PushPlan.check <counters.buffer.intake.PushPlan.check>` of its replies."""
        self.plan.check(replies)


Failed = tuple[Waiting | OnePush, BaseException]


class Acks:
    """One thread's line to the buffer of one database, and the pushes waiting on it.

    The line has writers of its own (:class:`~counters.buffer.pushids.Writer`),
    kept under its lock, which its sends and reads hold anyway: one per push
    waiting, each with one push in flight, as for the process's pool. A writer
    whose push is answered applied pushes again; one whose push failed is
    dropped, whatever its completion finds (a writer retired after a push that
    resolved costs only a new writer id).
    """

    def __init__(self, buffer: Buffer, using: str) -> None:
        self.buffer = buffer
        self.using = using
        self.line = Line(buffer)
        self.owner = threading.current_thread()
        self.lock = threading.Lock()
        self.waiting: deque[Waiting | OnePush] = deque()
        #: The line's writers with no push in flight.
        self.writers: list[Writer] = []
        #: The route kept for the thread's usual pushes (:func:`keep_route`): the epoch it
        #: holds in (-1: none), with what :func:`send` was given.
        self.kept = -1
        self.kept_complete: Complete | None = None
        self.kept_batch = 1

    def hand_on(self, deltas: Mapping[str, int], complete: Complete, batch: int) -> bool:
        """:func:`send` of ``deltas`` under the next push id of a writer of the line. False
        if never sent.

        The usual push, of one member, is made as a :class:`OnePush`, here: its command
        encoded at once (:meth:`~counters.buffer.intake.Intake.wire_one`), unless it must
        be planned (then, as any other, by :meth:`push`).
        """
        failed = None
        if len(deltas) == 1:
            ((member, delta),) = deltas.items()
            lock = self.lock
            lock.acquire()  # (not ``with``: the usual push's lock, at half the cost)
            try:
                writers = self.writers
                writer = writers.pop() if writers else Writer()
                seq = writer.seq + 1
                try:
                    wire = self.buffer.wire_one(member, delta, writer.id, seq)
                except BaseException:
                    writers.append(writer)  # never sent, its number never used
                    raise
                if wire is None:
                    writers.append(writer)
                else:
                    writer.seq = seq
                    push = OnePush(
                        self.buffer, wire, writer, seq, member, delta, self.using, complete
                    )
                    failed = self._write(push, push, batch)
            finally:
                lock.release()
        if failed is None:
            failed = self.push(deltas, complete, batch)
            if failed is None:
                return False  # never sent: the caller waits on its push
        state = _state
        if failed or state.thread is None or state.sleeping:
            _handed_on(failed)
        return True

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

    def _write(self, push: Waiting | OnePush, plan: PushPlan | OnePush, batch: int) -> list[Failed]:
        if batch > 1 and not _state.local.serving:
            return self._take(push, plan, batch)
        waiting = self.waiting
        try:
            self.line.send(plan)  # type: ignore[arg-type]  # a OnePush is its own plan
        except Exception as exc:
            return [*self._broken(exc), (push, exc)]
        waiting.append(push)
        if len(waiting) < MAX_WAITING and waiting[0].sent_at > push.sent_at - ACK_AFTER:
            return []
        return self._settle(keep=1)  # the replies before it, arrived by now: one read

    def _take(self, push: Waiting | OnePush, plan: PushPlan | OnePush, batch: int) -> list[Failed]:
        """:meth:`_write` of a thread that batches its writes (``batch`` above 1)."""
        line, waiting = self.line, self.waiting
        try:
            line.send(plan, now=False)  # type: ignore[arg-type]
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


class _Local(threading.local):
    """A thread's own: its lines (database alias -> :class:`Acks`), whether it serves a
    request."""

    def __init__(self) -> None:
        self.lines: dict[str, Acks] = {}
        self.serving = False


class _State:
    """This process's lines, and its acknowledging thread."""

    def __init__(self) -> None:
        self.local = _Local()
        #: A route kept in an epoch holds until the epoch moves on (:func:`keep_route`,
        #: :func:`forget_routes`).
        self.epoch = 0
        self.all: list[Acks] = []
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        #: Failed pushes to complete in the acknowledging thread (their reader was in a
        #: transaction), and how many of them are being completed.
        self.handed: deque[Failed] = deque()
        self.completing = 0
        self.thread: threading.Thread | None = None
        self.sleeping = False
        #: Requests served without the middleware: pushes are waited on.
        self.unguarded = False
        self.middleware = False
        self.hooked = False


_state = _State()


def middleware_loaded() -> None:
    """The acknowledging middleware runs in this process's request handler."""
    _state.middleware = True


def request_started(**kwargs: object) -> None:
    """``request_started``: a request served without the middleware waits on its pushes."""
    if not _state.middleware and not _state.unguarded:
        _state.unguarded = True
        forget_routes()
        acknowledge()


def serving(on: bool) -> None:
    """Whether this thread serves a request now: its pushes are written as it commits
    (:class:`~counters.middleware.AcknowledgeMiddleware`)."""
    _state.local.serving = on


def task_ended(**kwargs: object) -> None:
    """Celery's ``task_postrun``: the task's pushes are acknowledged before its result."""
    acknowledge()


def send(
    deltas: Mapping[str, int],
    using: str,
    buffer: Buffer,
    complete: Complete,
    push_id: PushId | None = None,
    batch: int = 1,
) -> bool:
    """Write the push of committed ``deltas`` to ``buffer`` now and read its reply later.

    False if this push must be waited on instead: a Redis Cluster, a member
    too large for a score, nothing to push, or a web process serving requests
    without :class:`~counters.middleware.AcknowledgeMiddleware`. Otherwise its
    push id ends when the reply is read, or ``complete`` ends it (also when
    the push could not be written). ``push_id``: an id allocated by the
    caller (an outbox row's); by default the next of a writer of the
    thread's line (:meth:`Acks.push`). ``batch``: ``COUNTERS_WRITE_BATCH``
    (:meth:`Acks.send`).
    """
    if _state.unguarded or not isinstance(buffer.client, Redis):
        return False
    if push_id is None:
        return _acks_of_thread(using, buffer).hand_on(deltas, complete, batch)
    plan = buffer.plan_push(deltas, push_id)
    if not plan.calls or plan.refused:
        return False
    failed = _acks_of_thread(using, buffer).send(
        Waiting(plan, push_id, deltas, using, complete), batch
    )
    state = _state
    if failed or state.thread is None or state.sleeping:
        _handed_on(failed)
    return True


def _handed_on(failed: list[Failed]) -> None:
    """After a push was handed to a line: complete the ``failed`` pushes of the replies
    read, and have the acknowledging thread running."""
    if failed:
        _finish(failed)
    _ensure_thread()


def route_epoch() -> int:
    """The epoch a route kept now holds in: read it before the checks that allow it."""
    return _state.epoch


def keep_route(using: str, buffer: Buffer, complete: Complete, batch: int, epoch: int) -> None:
    """Keep this thread's route to its line of ``using``: :func:`send_kept` hands its next
    pushes on as :func:`send` of ``buffer``, ``complete`` and ``batch`` would, without
    what decided them.

    Called once :func:`send` handed a push of ``buffer`` on. The caller checked,
    since :func:`route_epoch` gave it ``epoch``, that every push of the thread
    to ``using`` with no push id of its own takes that path:
    the settings, the buffer of ``using`` and its recorded layout. It holds
    until :func:`forget_routes`: a changed setting (``setting_changed``), a
    request served without the middleware, or a caller that knows the rest
    changed.
    """
    acks = _state.local.lines.get(using)
    if acks is not None and acks.buffer is buffer:  # the line :func:`send` wrote to
        acks.kept_complete = complete
        acks.kept_batch = batch
        acks.kept = epoch


def forget_routes(**kwargs: object) -> None:
    """Drop every thread's kept route (:func:`keep_route`): the next push of each is
    decided again. Connected to ``setting_changed``."""
    _state.epoch += 1


def send_kept(deltas: Mapping[str, int], using: str) -> bool:
    """:func:`send` of committed ``deltas`` (none zero) on the thread's kept route to
    ``using`` (:func:`keep_route`); False if it has none, or the push was not sent (the
    caller decides it as usual)."""
    state = _state
    acks = state.local.lines.get(using)
    if acks is None or acks.kept != state.epoch:
        return False
    return acks.hand_on(deltas, acks.kept_complete, acks.kept_batch)  # type: ignore[arg-type]


def acknowledge(using: str | None = None) -> None:
    """Read every waiting reply of this process (of database ``using``), completing failures.

    When this returns, every push this process committed before the call has
    applied in Redis, or was completed without it.
    """
    failed: list[Failed] = []
    for acks in _lines():
        if using is None or acks.using == using:
            failed.extend(acks.settle())
    _finish(failed)
    _wait_for_handed()


def writer_count() -> int:
    """The writers of this process's lines (:class:`Acks`), beside its pool's."""
    return sum(acks.writer_count() for acks in _lines())


def _lines() -> list[Acks]:
    with _state.lock:
        return list(_state.all)


def _acks_of_thread(using: str, buffer: Buffer) -> Acks:
    lines = _state.local.lines
    acks = lines.get(using)
    if acks is None or acks.buffer is not buffer:  # new, or the settings changed
        if acks is not None:
            _finish(acks.settle())
        acks = lines[using] = Acks(buffer, using)
        with _state.lock:
            _state.all.append(acks)
        if not _state.hooked:
            _state.hooked = True
            exits.on_exit(acknowledge)
    return acks


def _finish(failed: list[Failed]) -> None:
    """Complete ``failed`` pushes here, or hand those of a database in a transaction on."""
    for push, exc in failed:
        if connections[push.using].in_atomic_block and not _in_thread():
            with _state.lock:
                _state.handed.append((push, exc))
                _state.wake.notify()
            continue
        _complete(push, exc)


def _complete(push: Waiting | OnePush, exc: BaseException) -> None:
    try:
        push.complete(push.deltas, push.using, push.push_id, exc)
    except Exception:  # completes logs and never raises; the thread must live on
        logger.exception("could not complete push %s", push.push_id)


def _wait_for_handed() -> None:
    deadline = time.monotonic() + COMPLETE_TIMEOUT
    with _state.lock:
        while _state.handed or _state.completing:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.error("failed pushes were not completed in %.0fs", COMPLETE_TIMEOUT)
                return
            _state.wake.wait(left)


# -- the acknowledging thread ---------------------------------------------------------


def _in_thread() -> bool:
    return threading.current_thread() is _state.thread


def _ensure_thread() -> None:
    state = _state
    if state.thread is not None and not state.sleeping:
        return
    with state.lock:
        if state.thread is None:
            state.thread = threading.Thread(target=_run, name="counters-acks", daemon=True)
            state.thread.start()
        elif state.sleeping:
            state.sleeping = False
            state.wake.notify_all()


def _run() -> None:
    """Read replies nobody read within ``ACK_AFTER``; complete what readers handed on."""
    state = _state
    idle_rounds = 0
    while True:
        with state.lock:
            if not state.handed:
                if idle_rounds >= 20:
                    state.sleeping = True
                    while state.sleeping and not state.handed:
                        state.wake.wait()
                    idle_rounds = 0
                else:
                    state.wake.wait(ACK_AFTER)
            handed = list(state.handed)
            state.handed.clear()
            state.completing += len(handed)
        for push, exc in handed:
            _complete(push, exc)
        with state.lock:
            state.completing -= len(handed)
            state.wake.notify_all()
        busy = _read_late()
        idle_rounds = 0 if busy or handed else idle_rounds + 1


def _read_late() -> bool:
    """Settle the replies older than ``ACK_AFTER``; drop the lines of ended threads.

    True while some push is waiting.
    """
    before = time.monotonic() - ACK_AFTER
    busy = False
    for acks in _lines():
        _finish(acks.settle(older_than=before))
        if acks.idle() and not acks.owner.is_alive():
            with _state.lock:
                if acks in _state.all:  # a process forked or reset meanwhile has its own list
                    _state.all.remove(acks)
            acks.line.close()
        busy = busy or not acks.idle()
    return busy


def _forget_in_child() -> None:
    """After ``fork()``: the parent's lines and pushes are the parent's."""
    global _state
    _state = _State()


os.register_at_fork(after_in_child=_forget_in_child)
setting_changed.connect(forget_routes, dispatch_uid="counters.write.acks.routes")
