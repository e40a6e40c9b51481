"""Push ids: a writer id and a sequence number, as in Kafka's idempotent producer.

Every push to Redis carries a :class:`PushId`. Redis keeps, per shard and per
writer, the highest sequence number it applied (``<prefix>:{sN}:w:<writer>``,
see :mod:`counters.buffer.store`), so deduplication costs one small key per writer
and shard, however many pushes there are. It holds because of two rules:

- **A writer has one push in flight at a time, its sequence numbers in order.**
  A thread takes a writer from this process's pool, pushes, and gives it back.
  A repeat of the same push id (after a lost reply) is refused as a duplicate,
  and so is an older one delivered late.
- **A writer whose push did not resolve is retired.** If a push may have left
  without an answer (a timeout, a reset, a refusal as too late) and was not
  completed by a repeat, the writer is never used again: a failed push is
  always the last sequence number of its writer. Fencing that push id in Redis
  (:meth:`counters.buffer.store.Buffer.fence`) then tells whether it landed
  (high-water mark at or above it) or marks it so that a late delivery is refused.

The usual caller is :func:`counters.write.delivery.send`, which allocates, pushes and
releases or retires on its own. A line of :mod:`counters.write.acks` (pushes whose
replies are read later) keeps writers of its own (:class:`Writer`) under the same two
rules. Code that needs the id before the push (to store it with the transaction, as
text, before COMMIT) allocates it first::

    push_id = pushids.allocate()          # before COMMIT; str(push_id) can be stored
    ...                                   # COMMIT; if it rolls back: pushids.release(push_id)
    delivery.send(deltas, using, push_id=push_id)   # pushes, then releases or retires it

An allocated id ends in :func:`release` (the push resolved, or never happened)
or :func:`retire` (it may have left unanswered); :func:`send
<counters.write.delivery.send>` does that itself, and a code that pushes with
:meth:`Buffer.push <counters.buffer.store.Buffer.push>` directly calls one of them.
Until then its writer is used by no other push. Ending an id that is no longer
its writer's current one (already ended) changes nothing, so ending twice is
safe. A retired push id may be repeated or fenced later, by any process, from
its stored text (:meth:`PushId.parse`): its writer never sends a higher number.

A child process after ``os.fork()`` starts with an empty pool: writers are
never shared between processes.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Random bytes of a writer id (hex-encoded: twice as many characters).
WRITER_ID_BYTES = 8

_WRITER_RE = re.compile(r"^\S+$")


@dataclass(frozen=True, order=True, slots=True)
class PushId:
    """The identity of one push: ``str()`` is ``"<writer>:<seq>"``, :meth:`parse` reads it back."""

    writer: str
    seq: int

    def __post_init__(self) -> None:
        if not isinstance(self.writer, str) or not _WRITER_RE.match(self.writer):
            raise ValueError(f"a writer id is non-empty text without spaces: {self.writer!r}")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 1:
            raise ValueError(f"a push sequence number is an integer of at least 1: {self.seq!r}")

    def __str__(self) -> str:
        return f"{self.writer}:{self.seq}"

    @classmethod
    def parse(cls, text: str) -> PushId:
        """The push id written as ``"<writer>:<seq>"``; ValueError if ``text`` is not one."""
        writer, sep, seq = str(text).rpartition(":")
        if not sep or not seq.isdigit() or not seq.isascii():
            raise ValueError(f"not a push id (<writer>:<seq>): {text!r}")
        return cls(writer, int(seq))

    @classmethod
    def of(cls, value: PushId | str) -> PushId:
        """``value`` as a push id. Text that is not ``"<writer>:<seq>"`` (an id from
        before writer ids, or a hand-made one) names a writer that pushes once: seq 1."""
        if isinstance(value, PushId):
            return value
        try:
            return cls.parse(value)
        except ValueError:
            return cls(value, 1)

    def undo(self) -> PushId:
        """The push that takes this one back: its own writer, used for this number only,
        so repeating a take-back is idempotent too."""
        return PushId(f"{self.writer}-undo", self.seq)


class Writer:
    """A writer id and the last sequence number it handed out."""

    __slots__ = ("id", "seq")

    def __init__(self, writer_id: str | None = None) -> None:
        self.id = writer_id or secrets.token_hex(WRITER_ID_BYTES)
        self.seq = 0

    def next_push_id(self) -> PushId:
        self.seq += 1
        return self.push_id(self.seq)

    def push_id(self, seq: int) -> PushId:
        """The id of this writer's push number ``seq`` (at least 1)."""
        # A writer's own id and a positive count are valid: skip the checks of text (and the
        # frozen dataclass's own setattr, setting its slots directly).
        push_id = object.__new__(PushId)
        _set_writer(push_id, self.id)
        _set_seq(push_id, seq)
        return push_id


#: The slots of :class:`PushId`, set directly (past the frozen class's ``__setattr__``).
_set_writer = vars(PushId)["writer"].__set__
_set_seq = vars(PushId)["seq"].__set__

_lock = threading.Lock()
_idle: list[Writer] = []  # writers with no push in flight, ready for the next one
_busy: dict[str, Writer] = {}  # writer id -> writer whose push id is allocated
#: Writers retired by this process (a push that may have left unresolved).
retired_count = 0


def allocate() -> PushId:
    """The next push id of an idle writer (a new one if none is idle).

    The writer stays busy until :func:`release` or :func:`retire` of this id.
    """
    with _lock:
        writer = _idle.pop() if _idle else Writer()
        _busy[writer.id] = writer
        return writer.next_push_id()


def release(push_id: PushId) -> None:
    """The push of ``push_id`` resolved (applied, refused as a duplicate, or proven
    never sent): its writer may push again. Releasing twice is harmless."""
    with _lock:
        writer = _busy.get(push_id.writer)
        if writer is not None and writer.seq == push_id.seq:
            del _busy[push_id.writer]
            _idle.append(writer)


def retire(push_id: PushId) -> None:
    """The push of ``push_id`` may have left without an answer: its writer is never
    used again, so ``push_id`` stays its last sequence number."""
    global retired_count
    with _lock:
        writer = _busy.get(push_id.writer)
        if writer is not None and writer.seq == push_id.seq:
            del _busy[push_id.writer]
            retired_count += 1


def finish(push_id: PushId, resolved: bool) -> None:
    """:func:`release` if ``resolved``, else :func:`retire`."""
    if resolved:
        release(push_id)
    else:
        retire(push_id)


def next_push_id() -> PushId:
    """Alias of :func:`allocate`."""
    return allocate()


@contextmanager
def pushing() -> Iterator[PushId]:
    """A push id for one push: released on a normal exit, retired if the block raises.

    A block that learns its push did not resolve calls :func:`retire` itself
    (the release at exit is then a no-op).
    """
    push_id = allocate()
    try:
        yield push_id
    except BaseException:
        retire(push_id)
        raise
    release(push_id)


def pool_size() -> tuple[int, int]:
    """(idle, busy) writers of this process."""
    with _lock:
        return len(_idle), len(_busy)


def _after_fork_in_child() -> None:
    global _lock, retired_count
    _lock = threading.Lock()  # another thread may have held it at the fork
    _idle.clear()
    _busy.clear()
    retired_count = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
