"""The per-process sender: committed deltas queued in memory, pushed by a thread in batches.

With ``COUNTERS_SEND_DELAY_MS`` > 0 (200 by default), the write path no longer pushes after
every COMMIT. :func:`enqueue` adds the committed deltas to a queue of this
process (one per database alias), summed per member, and a background thread
pushes the queue in one round trip once it is ``COUNTERS_SEND_DELAY_MS`` old
or holds ``COUNTERS_SEND_BATCH`` commits, whichever comes first. Many commits
then cost one ``EVALSHA``, and the deltas of a busy key are summed before
they reach Redis.

What it trades, and how each guarantee is kept:

- **Read-your-writes in this process.** A read takes the process's queue into
  account (:func:`holding`): it waits for a push in progress to finish, keeps
  the thread from starting the next one while it reads, and adds what is
  still queued. Another process sees the deltas up to the delay later.
- **Read-your-writes in other processes** by the time a response is
  returned (:class:`~counters.middleware.AcknowledgeMiddleware`) or a Celery
  task ends: both push the queue first.
- **Redis down.** A batch goes through :func:`counters.write.delivery.send` like one
  commit: pushed with one idempotent id, or written to the DB directly.
- **Exit.** The queue is pushed at interpreter exit (``atexit``), at the end
  of a ``multiprocessing`` child (its finalizers), of a Celery prefork child
  (``worker_process_shutdown``, whose exit skips ``atexit``), of a gunicorn
  worker (``worker_exit`` in ``config/gunicorn.py``) and of a uWSGI worker
  (``uwsgi.atexit``).
- **Fork.** A child starts with no queue and no thread: what was queued
  belongs to the parent, whose thread pushes it.
- **A process killed (SIGKILL) loses its queue,** at most the delay's worth of
  commits, instead of the one commit between COMMIT and push it can lose
  without the sender. The continuous audit repairs it within a sweep of
  those keys; ``COUNTERS_DURABLE`` keeps it in the database until it is
  pushed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

from django.db import connections

from counters.base import conf
from counters.write import acks, exits

logger = logging.getLogger(__name__)

Deliver = Callable[[Mapping[str, int], str], None]

#: Seconds the exit hooks wait for a push in progress and the last batch.
DRAIN_TIMEOUT = 10.0


class Sender:
    """The queue of one database alias in this process, and the thread that pushes it."""

    def __init__(self, using: str, deliver: Deliver) -> None:
        self.using = using
        self._deliver = deliver
        self._cond = threading.Condition(threading.Lock())
        # Held while a batch is taken from the queue and pushed: a read holds it
        # too, so it never sees a batch both in the queue and in Redis, or in neither.
        self._pushing = threading.Lock()
        self._queue: dict[str, int] = {}
        self._commits = 0
        self._stopping = False
        self._batch = conf.send_batch()  # read again by the thread at every batch
        self._thread: threading.Thread | None = None
        self.batches = 0  # batches this sender has handed to the write path

    # -- writers --------------------------------------------------------------
    def put(self, deltas: Mapping[str, int]) -> bool:
        """Queue committed deltas; False once the sender is stopping (send them now)."""
        with self._cond:
            if self._stopping:
                return False
            queue = self._queue
            for member, delta in deltas.items():
                total = queue.get(member, 0) + delta
                if total:
                    queue[member] = total
                else:
                    queue.pop(member, None)
            self._commits += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"counters-sender-{self.using}", daemon=True
                )
                self._thread.start()
            if self._commits == 1 or self._commits >= self._batch:
                self._cond.notify()
        return True

    # -- readers --------------------------------------------------------------
    def queued(self, members: Iterable[str]) -> dict[str, int]:
        """Queued deltas of ``members`` (call with :meth:`hold` held)."""
        with self._cond:
            return {m: self._queue[m] for m in members if m in self._queue}

    @contextmanager
    def hold(self) -> Iterator[Sender]:
        """No batch leaves the queue while this is held (a push in progress finishes first)."""
        with self._pushing:
            yield self

    # -- the thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._commits == 0 and not self._stopping:
                    self._cond.wait()
                if self._commits == 0:
                    return  # stopping, nothing left
                self._batch = conf.send_batch()
                deadline = time.monotonic() + conf.send_delay()
                while not self._stopping and self._commits < self._batch:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            try:
                self.push_queue()
            finally:
                # A batch written to the database (Redis down) opened this thread's own
                # connection: closed at once, never left to the garbage collector.
                connections.close_all()

    def push_queue(self) -> None:
        """Push what is queued now (after a push in progress), in this thread."""
        with self._pushing:
            with self._cond:
                batch, self._queue, self._commits = self._queue, {}, 0
            if batch:
                self.batches += 1
                try:
                    self._deliver(batch, self.using)
                except Exception:  # the thread must live on: the next batch is not to blame
                    logger.exception("could not send %s queued deltas", len(batch))

    # -- exit -----------------------------------------------------------------
    def stop(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Push what is queued and end the thread; later commits are pushed at once."""
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.error("the counters sender did not finish pushing in %.0fs", timeout)
                return
        self.push_queue()  # anything queued after the thread's last batch


_senders: dict[str, Sender] = {}
_lock = threading.Lock()


def enabled() -> bool:
    return conf.write_switches().send_delay > 0


def describe_mode() -> dict[str, object]:
    """The write path's mode, for ``counters_status``: what it trades, if anything."""
    if not enabled():
        batch = conf.write_batch() if conf.defer_acks() else 1
        if batch > 1:
            return {
                "mode": "batched",
                "send_delay_ms": 0,
                "send_batch": None,
                "write_batch": batch,
                "trades": "outside a request, other processes see a commit up to 50 ms later; "
                + (
                    "a process killed loses nothing (durable mode)"
                    if conf.durable()
                    else f"a process killed with SIGKILL loses up to {batch - 1} of its "
                    "commits not yet written until the audit repairs them"
                ),
            }
        return {
            "mode": "per-commit",
            "send_delay_ms": 0,
            "send_batch": None,
            "write_batch": 1,
            "trades": None,
        }
    delay_ms = conf.get("COUNTERS_SEND_DELAY_MS")
    return {
        "mode": "sender",
        "send_delay_ms": delay_ms,
        "send_batch": conf.send_batch(),
        "write_batch": None,
        "trades": (
            f"outside a request or a Celery task, other processes see a commit up to "
            f"{delay_ms:g} ms later; "
            + (
                "a process killed loses nothing (durable mode)"
                if conf.durable()
                else f"a process killed with SIGKILL loses up to {delay_ms:g} ms of its "
                "commits until the audit repairs them"
            )
        ),
    }


def enqueue(deltas: Mapping[str, int], using: str, deliver: Deliver) -> bool:
    """Queue committed deltas for this process's sender; False if the caller must send them."""
    sender = _senders.get(using)
    if sender is None:
        with _lock:
            sender = _senders.get(using)
            if sender is None:
                _install_exit_hooks()
                sender = _senders[using] = Sender(using, deliver)
    return sender.put(deltas)


@contextmanager
def holding(using: str) -> Iterator[Sender | None]:
    """For a read: this process's sender of ``using`` held still, or None if it has none."""
    sender = _senders.get(using)
    if sender is None:
        yield None
        return
    with sender.hold():
        yield sender


def drain_queues(timeout: float = DRAIN_TIMEOUT) -> None:
    """Push every queue of this process now and stop the threads (exit hooks call this)."""
    for sender in list(_senders.values()):
        try:
            sender.stop(timeout)
        except Exception:
            logger.exception("could not drain the counters sender of %s", sender.using)
    acks.acknowledge()


def push_queued(using: str | None = None) -> None:
    """Push this process's queue of ``using`` (every alias if None) now, and wait for it."""
    for sender in list(_senders.values()):
        if using is None or sender.using == using:
            sender.push_queue()
    acks.acknowledge(using)


def task_ended(**kwargs: object) -> None:
    """Celery's ``task_postrun``: the task's commits are pushed and acknowledged before its
    result."""
    push_queued()


def reset() -> None:
    """Drain and forget every sender of this process (the next commit starts a new one)."""
    global _senders
    drain_queues()
    _senders = {}


def drain_on_signal(**kwargs: object) -> None:
    """Receiver of Celery's ``worker_process_shutdown`` (a prefork child skips ``atexit``)."""
    drain_queues()


def _install_exit_hooks() -> None:
    exits.on_exit(drain_queues)


def _forget_in_child() -> None:
    """After ``fork()``: the child has no thread, and the queue belongs to the parent."""
    global _senders, _lock
    _senders = {}
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
