"""One flush of the buffer: every shard drained once, in lanes that take turns at the database.

:func:`flush_buffer` picks the shards (all of them, or those given) and
visits them from a random one on; :class:`Lanes` drains them, one shard's
flush at a time per lane (:class:`~counters.flushing.shard.ShardFlush`),
the lanes' batches taking turns at the database. A shard that fails is
recorded and the others go on, unless Redis or the database is gone.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterable

from django.db import DEFAULT_DB_ALIAS, connections
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from counters.base import conf
from counters.base.utils import first_line
from counters.buffer.store import Buffer
from counters.flushing import ledger
from counters.flushing.quarantine import ERROR_LIMIT, error_line
from counters.flushing.result import FlushResult, added_up
from counters.flushing.shard import ShardFlush, database_gone

logger = logging.getLogger(__name__)


def chosen_shards(buffer: Buffer, shards: Iterable[int] | None) -> list[int]:
    """``shards`` sorted without repeats (every shard of ``buffer`` if None).

    Raises ``ValueError`` for a shard that ``buffer`` does not have, or an empty set.
    """
    if shards is None:
        return list(range(buffer.shards))
    items = list(shards)
    wrong = [
        s
        for s in items
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < buffer.shards
    ]
    if wrong:
        raise ValueError(
            f"shards {wrong!r} are not shards of this buffer (0 to {buffer.shards - 1})"
        )
    chosen = sorted(set(items))
    if not chosen:
        raise ValueError("no shards to flush: pass None for every shard")
    return chosen


def shard_failed(shard: int, exc: Exception, result: FlushResult) -> None:
    """Log and record a failed ``shard`` (its batch stays in flight); the others go on."""
    logger.error(
        "flush of shard %s failed (%s); its batch stays in flight",
        shard,
        error_line(exc),
        exc_info=logger.isEnabledFor(logging.DEBUG),  # the traceback only when debugging
    )
    result.failed_shards[shard] = first_line(exc, ERROR_LIMIT)


def flush_buffer(
    buffer: Buffer,
    *,
    using: str = DEFAULT_DB_ALIAS,
    batch_size: int = 5000,
    time_budget: float = 30.0,
    lease_timeout: float = 30.0,
    retention: int | None = None,
    shards: Iterable[int] | None = None,
    lanes: int | None = None,
) -> FlushResult:
    """Flush each shard of ``buffer`` once, or only ``shards``; returns a FlushResult.

    Each shard is drained under its own lease; shards another flusher holds
    are skipped (``busy_shards``). Several flushers given disjoint ``shards``
    (the parts of a parallel flush, see ``counters.ops.fanout``) work side by
    side; given the same shards they still apply each batch once. Shards are
    visited from a random one on, so that a budget that runs out leaves other
    shards behind each time. ``retention`` (seconds) prunes the ledger
    afterwards. Raises ``ValueError`` for shards ``buffer`` lacks, touching none.

    ``lanes`` (default ``COUNTERS_FLUSH_LANES``): shards drained side by side by
    this flush, each lane a thread with a database connection of its own
    (:class:`Lanes`), one batch's statements at a time among them: while one
    lane's batch is in the database, another moves and prepares its next
    batch, or commits the one before. One lane where that cannot be: inside
    a transaction on ``using`` (the lanes' connections would not see its
    rows), on SQLite (one writer), or for a single shard.
    """
    order = chosen_shards(buffer, shards)
    started = time.monotonic()
    deadline = started + time_budget
    offset = random.randrange(len(order))  # fairness when the time budget runs out
    order = order[offset:] + order[:offset]
    lanes = conf.flush_lanes() if lanes is None else lanes
    conn = connections[using]
    if conn.vendor == "sqlite" or conn.in_atomic_block:
        lanes = 1
    result = Lanes(buffer, order, using, batch_size, lease_timeout, deadline).run(lanes)
    if retention is not None:
        ledger.prune_ledger(buffer, using, retention)
    result.seconds = time.monotonic() - started
    logger.debug("%s", result.summary())
    return result


class Lanes:
    """Shards of one flush drained by several threads, one batch's statements at a time.

    A batch's apply waits on the database for most of its time; the epoch
    check, moving the next batch out of Redis and parsing it are the
    flusher's own work. With two lanes one does the latter while the other's
    statement runs. The lanes take turns (``turn``) for a batch's statements,
    from its BEGIN to its batch UPDATE: the database runs one flush
    statement at a time, as one flusher always did, except that a batch's
    COMMIT runs beside the next lane's statements. The lanes' shards are
    disjoint, so their transactions touch disjoint rows (counter rows,
    ledger rows, their shards' epoch rows), and the exactly-once argument
    is unchanged (each shard under its own lease, one lane per shard).

    Each lane takes the next shard of ``order`` when it finishes one, so a
    shard with a backlog does not hold the others up. The calling thread is
    the first lane; the others are threads whose database connection is
    closed when they end. A lane that meets Redis or the database gone stops
    every lane after its current shard, and the error is raised here.
    ``counters.signals.applied`` is sent from the lane that applied the batch.
    """

    def __init__(
        self,
        buffer: Buffer,
        order: list[int],
        using: str,
        batch_size: int,
        lease_timeout: float,
        deadline: float,
    ) -> None:
        self.buffer, self.using, self.batch_size = buffer, using, batch_size
        self.lease_timeout, self.deadline = lease_timeout, deadline
        self.waiting = list(reversed(order))
        self.lock = threading.Lock()
        #: Held by the lane applying a batch; None with one lane.
        self.turn: threading.Lock | None = None
        self.failures: list[BaseException] = []

    def run(self, lanes: int) -> FlushResult:
        """Drain every shard in up to ``lanes`` lanes (one per shard at most); what they did."""
        results = [FlushResult() for _ in range(max(1, min(lanes, len(self.waiting))))]
        if len(results) > 1:
            self.turn = threading.Lock()
        threads = [
            threading.Thread(
                target=self._lane_thread, args=(part,), name=f"counters-flush-lane-{i}"
            )
            for i, part in enumerate(results[1:], 1)
        ]
        for thread in threads:
            thread.start()
        try:
            self._lane(results[0])
        finally:
            for thread in threads:
                thread.join()
        if self.failures:
            raise self.failures[0]
        return added_up(results)

    def _next(self) -> int | None:
        with self.lock:
            if self.failures or not self.waiting:
                return None
            return self.waiting.pop()

    def _lane(self, result: FlushResult) -> None:
        try:
            while (shard := self._next()) is not None:
                self._flush_shard(shard, result)
        except BaseException as exc:
            with self.lock:
                self.failures.append(exc)

    def _flush_shard(self, shard: int, result: FlushResult) -> None:
        """One shard's flush (:class:`ShardFlush`); its failure is recorded in ``result``
        (``failed_shards``) unless Redis or the database is gone: then it raises."""
        flusher = ShardFlush(
            self.buffer,
            shard,
            using=self.using,
            batch_size=self.batch_size,
            lease_timeout=self.lease_timeout,
            deadline=self.deadline,
            result=result,
            turn=self.turn,
        )
        try:
            flusher.run()
        except (RedisConnectionError, RedisTimeoutError):
            raise  # Redis is unreachable: no other shard can do better
        except Exception as exc:
            if database_gone(self.using):
                raise  # the database is gone: no other shard can do better
            shard_failed(shard, exc, result)

    def _lane_thread(self, result: FlushResult) -> None:
        try:
            self._lane(result)
        finally:
            connections.close_all()  # this thread's own connections
