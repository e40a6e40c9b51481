"""Reads of the buffer: what Redis holds for some members at one instant.

Each shard is read by one script, so its pending, in-flight and quarantined
sums and its generation (bumped by every move and ack) are consistent with
each other; the reader compares generations to tell whether a batch moved
between two reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from redis.commands.core import Script

from counters.base.utils import to_str
from counters.buffer.keyspace import Keyspace, int_reply
from counters.buffer.pushids import PushId


@dataclass(frozen=True)
class Snapshot:
    """What Redis holds for some members at one instant.

    ``hwms`` has the high-water mark of each writer of the requested push
    ids (and of their take-backs) in each shard read: (shard, writer) ->
    highest sequence number applied there (0: none, or forgotten).
    """

    gens: dict[int, int]
    inflight_ids: dict[int, str]
    pending: dict[str, int]
    inflight: dict[str, int]
    hwms: dict[tuple[int, str], int] = field(default_factory=dict)
    #: Sum of each member's quarantined deltas: not applied, not lost, part of its value.
    quarantined: dict[str, int] = field(default_factory=dict)

    def applied(self, shard: int, push_id: PushId | str) -> bool:
        """Did push ``push_id`` apply in ``shard``? (For the last push of its writer:
        the writer of an unsettled direct write was retired with it.)"""
        push_id = PushId.of(push_id)
        return self.hwms.get((shard, push_id.writer), 0) >= push_id.seq


class Snapshots(Keyspace):
    """Consistent reads of members, per shard, and of shard generations."""

    _read: Script

    def snapshot(self, members: Iterable[str], push_ids: Iterable[PushId | str] = ()) -> Snapshot:
        """Pending, in-flight and quarantined deltas of ``members``, each shard read atomically,
        with the high-water marks of the writers of ``push_ids`` (and of their
        take-backs) in those shards: see :meth:`Snapshot.applied`."""
        groups = self.by_shard(members)
        ids = [PushId.of(p) for p in push_ids]
        names = list(dict.fromkeys(w for p in ids for w in (p.writer, p.undo().writer)))
        calls = [
            (
                [*self._shard_keys(shard), self.key(shard, "qsum")]
                + [self.writer_key(shard, w) for w in names],
                group,
            )
            for shard, group in groups.items()
        ]
        replies = self._run(self._read, calls)
        snap = Snapshot({}, {}, {}, {}, {}, {})
        for (shard, group), reply in zip(groups.items(), replies, strict=True):
            snap.gens[shard] = int_reply(reply[0])
            if reply[1]:
                snap.inflight_ids[shard] = to_str(reply[1])
            for i, member in enumerate(group):
                snap.pending[member] = int_reply(reply[2 + 3 * i])
                snap.inflight[member] = int_reply(reply[3 + 3 * i])
                snap.quarantined[member] = int_reply(reply[4 + 3 * i])
            offset = 2 + 3 * len(group)
            for i, name in enumerate(names):
                snap.hwms[(shard, name)] = int_reply(reply[offset + i])
        return snap

    def generations(self, shards: Iterable[int]) -> dict[int, int]:
        shards = list(shards)
        pipe = self.client.pipeline(transaction=False)
        for shard in shards:
            pipe.get(self.key(shard, "gen"))
        return {s: int_reply(v or 0) for s, v in zip(shards, pipe.execute(), strict=True)}
