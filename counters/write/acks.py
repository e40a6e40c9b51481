"""Pushes acknowledged later: the committing thread hands its push on and does not wait.

With ``COUNTERS_DEFER_ACKS`` on (the default), :func:`send` hands a
committed push to a line of the thread's own (:class:`~counters.write.replies.Acks`)
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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping

from django.db import connections
from redis import Redis

from counters.buffer.pushids import PushId
from counters.buffer.store import Buffer
from counters.write import exits, replies
from counters.write.replies import Acks, Complete, Failed, ThreadLines, Waiting

logger = logging.getLogger(__name__)

#: Seconds a read waits for the acknowledging thread to complete failed pushes.
COMPLETE_TIMEOUT = 30.0


class _State:
    """This process's lines, and its acknowledging thread."""

    def __init__(self) -> None:
        self.local = ThreadLines()
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
        acknowledge()


def serving(on: bool) -> None:
    """Whether this thread serves a request now: its pushes are written as it commits
    (:class:`~counters.middleware.AcknowledgeMiddleware`)."""
    _state.local.serving = on


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
        return _handed_on(_acks_of_thread(using, buffer).push(deltas, complete, batch))
    plan = buffer.plan_push(deltas, push_id)
    if not plan.calls or plan.refused:
        return False
    return _handed_on(
        _acks_of_thread(using, buffer).send(Waiting(plan, push_id, deltas, using, complete), batch)
    )


def _handed_on(failed: list[Failed] | None) -> bool:
    """After a push was handed to a line: False if it was never sent; else complete the
    ``failed`` pushes of the replies read, and have the acknowledging thread running."""
    if failed is None:
        return False
    state = _state
    if failed or state.thread is None or state.sleeping:
        if failed:
            _finish(failed)
        _ensure_thread()
    return True


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
        acks = lines[using] = Acks(buffer, using, _state.local)
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


def _complete(push: Waiting, exc: BaseException) -> None:
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
                    state.wake.wait(replies.ACK_AFTER)
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
    before = time.monotonic() - replies.ACK_AFTER
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
