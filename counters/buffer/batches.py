"""Batches: pending deltas moved in flight for the flush, then acknowledged or narrowed.

A shard has at most one batch in flight. The flush moves up to a limit of
pending members into it under a new id and the shard's next sequence
number, applies it to the database, and acknowledges it (with the move of
the next). A batch still in flight when a flush starts is returned again
(``recovered``), never moved twice. Narrowing sends some members back to
pending and keeps the rest in flight under a new id.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from redis.exceptions import ResponseError

from counters.base.exceptions import RedisTooOld, UnexpectedScriptReply
from counters.base.utils import to_str
from counters.buffer.keyspace import Keyspace, int_reply
from counters.buffer.scripts import DrainScript


@dataclass(frozen=True)
class Batch:
    """Deltas moved to a shard's in-flight set under one id.

    ``recovered`` is True when the batch was already in flight (a previous
    flusher moved it and did not acknowledge it). ``seq`` is the shard's
    sequence number of the batch (0 for an empty move), ``prefix`` the key
    prefix of the buffer it came from.
    """

    shard: int
    batch_id: str
    moved_at_ms: int
    items: dict[str, int]
    recovered: bool
    seq: int = 0
    prefix: str = ""


class Batches(Keyspace):
    """Move, acknowledge and narrow the batch in flight of each shard."""

    _move: DrainScript
    _ack: DrainScript
    _narrow: DrainScript

    def pending_count(self, shard: int) -> int:
        return int(self.client.zcard(self.key(shard, "pending")))

    def move(
        self,
        shard: int,
        batch_id: str,
        limit: int,
        only: Iterable[str] = (),
        ack: str | None = None,
    ) -> Batch | None:
        """Move up to ``limit`` pending members into a new in-flight batch.

        With ``only``, just those members that are pending are moved (members
        a narrowed batch sent back, see :meth:`narrow`). If a batch is already
        in flight it is returned instead (``recovered``); None means the
        shard had nothing (of ``only``) pending. ``ack`` first forgets that
        batch if it is still in flight, as :meth:`ack` does, in the same
        script: the flush acknowledges a batch with the move of the next.
        """
        now_ms = int(time.time() * 1000)
        keys = [*self._shard_keys(shard), self.key(shard, "seq")]
        try:
            reply = self._move(keys=keys, args=[batch_id, limit, now_ms, ack or "", *only])
        except ResponseError as exc:
            # Redis before 6.2 refuses the script's ZRANGESTORE (6.0 without naming it).
            message = str(exc).lower()
            if "zrangestore" in message or "unknown redis command" in message:
                raise RedisTooOld("ZRANGESTORE") from exc
            raise
        status = to_str(reply[0])
        if status == "empty":
            return None
        if status not in ("inflight", "moved"):
            raise UnexpectedScriptReply("MOVE_SCRIPT", reply)
        flat = reply[3]
        members = flat[0::2]
        scores = flat[1::2]
        items = dict(
            zip(
                map(bytes.decode, members)
                if members and isinstance(members[0], bytes)
                else map(to_str, members),
                scores if all(type(v) is int for v in scores) else map(int_reply, scores),
                strict=True,
            )
        )
        return Batch(
            shard=shard,
            batch_id=to_str(reply[1]),
            moved_at_ms=int_reply(reply[2]),
            items=items,
            recovered=status == "inflight",
            seq=int_reply(reply[4]),
            prefix=self.prefix,
        )

    def ack(self, shard: int, batch_id: str) -> bool:
        """Drop the in-flight batch if it is still ``batch_id``; False if it was not."""
        keys = [self.key(shard, "inflight"), self.key(shard, "batch"), self.key(shard, "gen")]
        reply = self._ack(keys=keys, args=[batch_id])
        if reply not in (0, 1):
            raise UnexpectedScriptReply("ACK_SCRIPT", reply)
        return reply == 1

    def narrow(
        self, batch: Batch, new_id: str, returned: Iterable[str], renumber: bool = False
    ) -> Batch | None:
        """Send ``returned`` members of in-flight ``batch`` back to pending; keep the rest
        in flight as batch ``new_id``.

        The narrowed batch keeps the sequence number of ``batch``, or with
        ``renumber`` takes the shard's next one, in the same script: the flush
        renumbers, so that a Redis restored from a state older than the
        narrowing is behind the DB once the narrowed batch is applied (see
        :mod:`counters.flushing.epoch`). A member whose pending sum would leave the
        exact range of a score stays in flight. Returns the narrowed batch, or
        None if ``batch`` is no longer the batch in flight.
        """
        shard = batch.shard
        keys = [
            self.key(shard, "pending"),
            self.key(shard, "inflight"),
            self.key(shard, "batch"),
            self.key(shard, "gen"),
            self.key(shard, "since"),
        ]
        if renumber:
            keys.append(self.key(shard, "seq"))
        now_ms = int(time.time() * 1000)
        reply = self._narrow(keys=keys, args=[batch.batch_id, new_id, now_ms, *returned])
        if reply == [0]:
            return None
        if not (isinstance(reply, list) and len(reply) == 3 and reply[0] == 1):
            raise UnexpectedScriptReply("NARROW_SCRIPT", reply)
        flat, number = reply[1], int_reply(reply[2])
        items = {to_str(flat[i]): int_reply(flat[i + 1]) for i in range(0, len(flat), 2)}
        if not set(items) <= set(batch.items) or (number > 0) != renumber:
            raise UnexpectedScriptReply("NARROW_SCRIPT", reply)
        return Batch(
            shard=shard,
            batch_id=new_id,
            moved_at_ms=batch.moved_at_ms,
            items=items,
            recovered=batch.recovered,
            seq=number or batch.seq,
            prefix=batch.prefix,
        )

    def inflight_ids(self) -> dict[int, str]:
        """Batch id in flight per shard, for shards that have one."""
        pipe = self.client.pipeline(transaction=False)
        for shard in range(self.shards):
            pipe.hget(self.key(shard, "batch"), "id")
        return {s: to_str(v) for s, v in enumerate(pipe.execute()) if v is not None}
