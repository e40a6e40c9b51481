"""Deltas set aside: each shard's quarantine, and the quarantined sum of each member.

A delta the flush cannot apply on its own is held in its shard's quarantine
hash under ``"<batch id>|<member>"``, with its error; a delta a direct write
could not apply is held the same way under ``"<origin>|<member>"``. The same
scripts keep ``qsum``, the sum of each member's held deltas, which reads
count as buffered: a held delta is not applied, and not lost. Requeue puts
deltas back into pending, discard drops them; each acts on a field at most
once. The flush decides what to hold; :mod:`counters.flushing.quarantine` what to
retry or discard.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import cast

from redis.commands.core import Script

from counters.base.exceptions import UnexpectedScriptReply
from counters.base.utils import to_str
from counters.buffer.batches import Batch
from counters.buffer.keyspace import SCORE_LIMIT, Keyspace, shard_of
from counters.buffer.scripts import DrainScript

#: Longest error text kept with a quarantined delta.
QUARANTINE_ERROR_LIMIT = 300


@dataclass(frozen=True)
class Quarantined:
    """A delta that failed to apply on its own, held in its shard's quarantine hash.

    ``field`` is its key in the hash, ``"<batch id>|<member>"``: the batch
    it failed in makes it unique, and quarantining it again after a crash
    writes the same field. ``counted`` says the delta is in its member's
    quarantined sum (``qsum``), as every delta quarantined since that sum exists is.
    """

    shard: int
    field: str
    member: str
    delta: int
    error: str
    at: float
    counted: bool = True

    @property
    def uncount(self) -> int:
        """What taking it out of the quarantine adds to its member's quarantined sum."""
        return -self.delta if self.counted else 0

    @property
    def counter(self) -> str:
        return self.member.partition(":")[0]


class Aside(Keyspace):
    """Quarantine, list, requeue, discard and set aside the held deltas of a buffer."""

    _quarantine: DrainScript
    _requeue: Script
    _discard: DrainScript
    _set_aside: DrainScript

    def quarantine(self, batch: Batch, error: str) -> bool:
        """Move every member of in-flight ``batch`` into the shard's quarantine with
        ``error``, and forget the batch. False if it is no longer the batch in flight."""
        shard = batch.shard
        keys = [
            self.key(shard, "inflight"),
            self.key(shard, "batch"),
            self.key(shard, "gen"),
            self.key(shard, "quarantine"),
            self.key(shard, "qsum"),
        ]
        error = error[:QUARANTINE_ERROR_LIMIT]
        at = round(time.time(), 3)
        args: list[str | int] = [batch.batch_id]
        for member, delta in sorted(batch.items.items()):
            value = {"member": member, "delta": delta, "error": error, "at": at, "counted": True}
            args.extend((f"{batch.batch_id}|{member}", json.dumps(value), member, delta))
        reply = self._quarantine(keys=keys, args=args)
        if reply not in (0, 1):
            raise UnexpectedScriptReply("QUARANTINE_SCRIPT", reply)
        return reply == 1

    def quarantined(self, shards: Iterable[int] | None = None) -> list[Quarantined]:
        """Every quarantined delta of ``shards`` (default: all), oldest first."""
        shards = list(range(self.shards) if shards is None else shards)
        pipe = self.client.pipeline(transaction=False)
        for shard in shards:
            pipe.hgetall(self.key(shard, "quarantine"))
        entries = []
        for shard, raw in zip(shards, pipe.execute(), strict=True):
            for field_, value in raw.items():
                data = json.loads(value)
                entries.append(
                    Quarantined(
                        shard=shard,
                        field=to_str(field_),
                        member=str(data["member"]),
                        delta=int(data["delta"]),
                        error=str(data.get("error", "")),
                        at=float(data.get("at", 0)),
                        counted=bool(data.get("counted", False)),
                    )
                )
        entries.sort(key=lambda e: (e.at, e.field))
        return entries

    def requeue(self, entries: Iterable[Quarantined]) -> tuple[int, list[Quarantined]]:
        """Put quarantined deltas back into pending, each at most once (atomic per shard).

        Returns how many were put back, and the entries left in quarantine
        because their pending sum would leave the exact range of a score.
        Entries no longer in quarantine (already requeued or discarded) are skipped.
        """
        by_shard: dict[int, list[Quarantined]] = defaultdict(list)
        for entry in entries:
            by_shard[entry.shard].append(entry)
        if not by_shard:
            return 0, []
        now_ms = int(time.time() * 1000)
        calls = [
            (
                [
                    self.key(shard, "pending"),
                    self.key(shard, "quarantine"),
                    self.key(shard, "since"),
                    self.key(shard, "qsum"),
                ],
                [now_ms, *(x for e in group for x in (e.field, e.member, e.delta, e.uncount))],
            )
            for shard, group in by_shard.items()
        ]
        replies = self._run(self._requeue, calls)
        requeued, refused = 0, cast(list[Quarantined], [])
        for group, reply in zip(by_shard.values(), replies, strict=True):
            fields = {e.field: e for e in group}
            if not (isinstance(reply, list) and reply and isinstance(reply[0], int)):
                raise UnexpectedScriptReply("REQUEUE_SCRIPT", reply)
            names = [to_str(f) for f in reply[1:]]
            if not set(names) <= set(fields):
                raise UnexpectedScriptReply("REQUEUE_SCRIPT", reply)
            requeued += reply[0]
            refused.extend(fields[name] for name in names)
        return requeued, refused

    def set_aside(self, items: Mapping[str, tuple[int, str]], origin: str) -> None:
        """Quarantine deltas that never entered Redis: ``{member: (delta, error)}``.

        For a direct write to the database that could not apply them (a value
        beyond the column's range): they are held like a flush's quarantine,
        under fields ``"<origin>|<member>"``, so writing them again after a
        crash writes the same fields and adds nothing. Like a flush's, each
        is part of its member's quarantined sum (reads count it) while it is
        exact as a score (below 2^53); a larger one is held uncounted.
        """
        at = round(time.time(), 3)
        by_shard: dict[int, list[str]] = defaultdict(list)
        for member, (delta, error) in sorted(items.items()):
            counted = abs(delta) < SCORE_LIMIT
            value = {
                "member": member,
                "delta": delta,
                "error": error[:QUARANTINE_ERROR_LIMIT],
                "at": at,
                "counted": counted,
            }
            by_shard[shard_of(member, self.shards)] += [
                f"{origin}|{member}",
                json.dumps(value),
                member,
                str(delta if counted else 0),
            ]
        calls = [
            ([self.key(shard, "quarantine"), self.key(shard, "qsum")], args)
            for shard, args in sorted(by_shard.items())
        ]
        if calls:
            replies = self._run(self._set_aside, calls)
            if not all(isinstance(n, int) for n in replies):
                raise UnexpectedScriptReply("SET_ASIDE_SCRIPT", replies)

    def discard(self, entries: Iterable[Quarantined]) -> int:
        """Delete quarantined deltas for good; returns how many were still there."""
        by_shard: dict[int, list[Quarantined]] = defaultdict(list)
        for entry in entries:
            by_shard[entry.shard].append(entry)
        if not by_shard:
            return 0
        calls = [
            (
                [self.key(shard, "quarantine"), self.key(shard, "qsum")],
                [x for e in group for x in (e.field, e.member, e.uncount)],
            )
            for shard, group in by_shard.items()
        ]
        replies = self._run(self._discard, calls)
        if not all(isinstance(n, int) for n in replies):
            raise UnexpectedScriptReply("DISCARD_SCRIPT", replies)
        return sum(replies)
