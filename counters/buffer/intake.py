"""Deltas entering the buffer: pushes, each applied at most once, and fences.

A push adds deltas to the pending sets of their shards, one atomic script
per shard, under a push id (:mod:`counters.buffer.pushids`): each shard
keeps the highest push applied per writer, so a repeat or an older push
delivered late adds nothing. A fence closes the last push of a retired
writer: it tells whether that push applied, and otherwise makes sure it
never will.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from zlib import crc32

from redis.commands.core import Script

from counters.base.exceptions import ScoreLimitExceeded, StalePush, UnexpectedScriptReply
from counters.base.utils import to_str
from counters.buffer import live
from counters.buffer.keyspace import SCORE_LIMIT, Keyspace
from counters.buffer.pushids import PushId
from counters.buffer.scripts import DrainScript

#: A push delivered later than this after it was sent is refused (a late TCP delivery
#: after the writer gave up and wrote to the DB instead).
PUSH_MAX_AGE_MS = 30_000
#: How long a writer's high-water mark is kept after its last push or fence; longer than
#: PUSH_MAX_AGE_MS plus the time a flush needs to fence the pushes of fallback writes.
PUSH_MARKER_TTL_MS = 180_000
#: The (shard, writer) keys of pushes kept for the next push of the same writer.
PUSH_KEYS_CACHED = 4096


class Intake(Keyspace):
    """Push and fence: how deltas enter the pending sets of a buffer."""

    _push: Script
    _fence: DrainScript

    def push(self, deltas: Mapping[str, int], push_id: PushId | str) -> set[int]:
        """Add ``deltas`` ({member: delta}) in one round trip, one atomic script per shard.

        ``push_id`` (a :class:`~counters.buffer.pushids.PushId`; text is read with
        :meth:`PushId.of`) makes the call idempotent: each shard applies a
        writer's pushes only in increasing order, so repeating the call (after
        a lost reply) adds nothing twice, and neither does an older push of the
        same writer delivered late. Returns the shards this call changed (a
        shard that already had this push is left out).

        A score is a double, exact for integers below 2**53 in magnitude. A
        delta that large is never sent, and a shard where some member's sum
        would reach it adds nothing: :class:`ScoreLimitExceeded` then names
        those members. The caller applies them elsewhere and pushes the rest
        again with the same id, which completes the refused shards only.
        """
        plan = self.plan_push(deltas, push_id)
        replies = self._run(self._push, plan.calls) if plan.calls else []
        return plan.outcome(replies)

    def plan_push(self, deltas: Mapping[str, int], push_id: PushId | str) -> PushPlan:
        """The scripts :meth:`push` runs for ``deltas`` (one per shard), to send now or later.

        :meth:`PushPlan.outcome` reads their replies as :meth:`push` does.
        """
        pid = push_id if type(push_id) is PushId else PushId.of(push_id)
        if len(deltas) == 1:  # a push of one member: its shard's script alone
            ((member, delta),) = deltas.items()
            if type(delta) is int and 0 < abs(delta) < SCORE_LIMIT:
                shard = crc32(member.encode()) % self.shards
                now_ms = time.time_ns() // 1_000_000
                writer, seq = pid.writer, pid.seq
                entry = self._push_keys_cache.get((shard, writer))
                if entry is None:
                    entry = self._push_entry(shard, writer)
                if live.LIVE_COUNTERS and live.is_live(member):  # with the start of its channel
                    entry = self._live_entry(shard, writer, entry[0])
                keys, head = entry
                call = [PUSH_MARKER_TTL_MS, now_ms, PUSH_MAX_AGE_MS, seq, member, delta]
                plan = PushPlan(push_id, deltas, {shard: [member, delta]}, {}, [(keys, call)])
                fixed = PUSH_MAX_AGE_MS is _AGE and PUSH_MARKER_TTL_MS is _TTL
                if head and fixed and member.isascii():
                    plan.wire = encode_one(head, now_ms, seq, member, delta)
                return plan
        groups: dict[int, list[str | int]] = {}
        refused: dict[str, int] = {}
        shards = self.shards
        for member, delta in deltas.items():
            if not delta:
                continue
            if abs(delta) >= SCORE_LIMIT:
                refused[member] = int(delta)
                continue
            shard = crc32(member.encode()) % shards  # keyspace.shard_of, inlined
            args = groups.get(shard)
            if args is None:
                args = groups[shard] = []
            args += (member, int(delta))
        now_ms = time.time_ns() // 1_000_000
        writer, seq = pid.writer, pid.seq
        calls: Sequence[tuple[Sequence[str], list]] = [
            (
                self._push_keys(shard, writer),
                [PUSH_MARKER_TTL_MS, now_ms, PUSH_MAX_AGE_MS, seq, *args],
            )
            for shard, args in groups.items()
        ]
        if live.LIVE_COUNTERS:  # members of live counters: published by the script
            calls = live.live_calls(self.prefix, groups, calls)
        return PushPlan(push_id, deltas, groups, refused, calls)

    def _push_keys(self, shard: int, writer: str) -> tuple[str, ...]:
        """KEYS of the push script in ``shard`` for ``writer``: pending, writer, since, suspects.

        Kept per (shard, writer): a process pushes with a few writers (its pool). The same
        tuple each time, so that a :class:`~counters.buffer.line.Line` keeps its encoding.
        """
        entry = self._push_keys_cache.get((shard, writer))
        if entry is None:
            entry = self._push_entry(shard, writer)
        return entry[0]

    def _push_entry(self, shard: int, writer: str) -> tuple[tuple[str, ...], str]:
        """:meth:`_push_keys` and the encoded start of a one-member push with them
        (:func:`push_head`), kept."""
        cache = self._push_keys_cache
        if len(cache) >= PUSH_KEYS_CACHED:
            cache.clear()  # retired writers' keys
        keys = (
            f"{self.prefix}:{{s{shard}}}:pending",
            f"{self.prefix}:{{s{shard}}}:w:{writer}",
            f"{self.prefix}:{{s{shard}}}:since",
            f"{self.prefix}:{{s{shard}}}:suspects",
        )
        entry = cache[(shard, writer)] = (keys, push_head(self._push.sha, keys))
        return entry

    def _live_entry(
        self, shard: int, writer: str, keys: tuple[str, ...]
    ) -> tuple[tuple[str, ...], str]:
        """The keys of a push of live members only in ``shard`` by ``writer`` (``keys``, the
        push's own, and the start of the shard's channels) and the encoded start of such a
        push of one member (its arguments are those of any push: every member it names is
        live), kept."""
        cache = self._live_keys_cache
        entry = cache.get((shard, writer))
        if entry is None:
            if len(cache) >= PUSH_KEYS_CACHED:
                cache.clear()  # retired writers' keys
            live_keys = (*keys, live.channel_base(self.prefix, shard))
            entry = cache[(shard, writer)] = (live_keys, push_head(self._push.sha, live_keys))
        return entry

    def fence(self, members: Iterable[str], push_id: PushId | str) -> set[int]:
        """Make push ``push_id`` of ``members`` unable to apply from now on.

        ``push_id`` must be the last push of its writer (the writer was retired
        after it). Returns the shards where it had already been applied (a
        late delivery of a push the writer gave up on). Text that is not a
        ``"<writer>:<seq>"`` id also fences the marker key such an id had
        before writer ids (``push:<id>``), for direct writes made before them.
        """
        pid = PushId.of(push_id)
        legacy = isinstance(push_id, str) and str(pid) != push_id
        shards = sorted(self.by_shard(members))
        calls = []
        for shard in shards:
            keys = [self.writer_key(shard, pid.writer)]
            if legacy:
                keys.append(self.key(shard, f"push:{push_id}"))
            calls.append((keys, [PUSH_MARKER_TTL_MS, pid.seq]))
        replies = self._run(self._fence, calls) if calls else []
        if any(reply not in (0, 1) for reply in replies):
            raise UnexpectedScriptReply("FENCE_SCRIPT", replies)
        return {shard for shard, reply in zip(shards, replies, strict=True) if reply == 1}

    def landed(self, pushes: Sequence[tuple[Iterable[str], PushId | str]]) -> list[set[str]]:
        """For each ``(members, push_id)``: those of its members whose shard applied that push.

        Read-only, one round trip: the high-water mark of the push's writer in
        each shard (``HGET <prefix>:{sN}:w:<writer> seq``) at or above its
        sequence number. A writer pushes in order and is retired after a push
        that did not resolve, so a mark at or above it means the push applied
        there. A member is left out once its shard's mark is lower, or gone:
        never applied there, or applied longer ago than ``PUSH_MARKER_TTL_MS``
        after its writer's last push (nothing can be known of it then).
        """
        wanted: list[tuple[int, dict[str, str]]] = []  # per push: seq, member -> writer key
        reads: dict[str, int] = {}  # writer key -> its position in the pipeline
        for members, push_id in pushes:
            pid = PushId.of(push_id)
            keys = {m: self.writer_key(self.shard_of(m), pid.writer) for m in members}
            for key in keys.values():
                reads.setdefault(key, len(reads))
            wanted.append((pid.seq, keys))
        marks: list[int] = []
        if reads:
            pipe = self.client.pipeline(transaction=False)
            for key in reads:
                pipe.hget(key, "seq")
            marks = [int(to_str(mark)) if mark is not None else 0 for mark in pipe.execute()]
        return [{m for m, key in keys.items() if marks[reads[key]] >= seq} for seq, keys in wanted]


def _bulk(value: int) -> str:
    text = str(value)
    return f"${len(text)}\r\n{text}\r\n"


#: The push script's first and third arguments, the same in every push, encoded once (a
#: push made when they differ, as a test may make them, is encoded by hiredis).
_TTL, TTL_ENCODED = PUSH_MARKER_TTL_MS, _bulk(PUSH_MARKER_TTL_MS)
_AGE, MAX_AGE_ENCODED = PUSH_MAX_AGE_MS, _bulk(PUSH_MAX_AGE_MS)


def push_head(sha: str, keys: Sequence[str]) -> str:
    """The start of a one-member push's command (RESP): ``EVALSHA``, the script's ``sha``,
    ``keys`` and the first argument, the same in every push; "" if a key is not ASCII."""
    parts = ["EVALSHA", sha, str(len(keys)), *keys]
    if not all(part.isascii() for part in parts):
        return ""
    head = f"*{len(parts) + 6}\r\n" + "".join(f"${len(p)}\r\n{p}\r\n" for p in parts)
    return head + TTL_ENCODED


#: ``"$<n>\r\n"``, the start of a bulk string of ``n`` bytes, for the usual lengths.
_LENGTHS = tuple(f"${n}\r\n" for n in range(256))
#: The last argument of a push of one member, for the usual deltas.
_DELTAS = {delta: _bulk(delta) for delta in (1, -1)}


def encode_one(head: str, now_ms: int, seq: int, member: str, delta: int) -> bytes:
    """The command of a push of one ``member`` of ASCII (RESP), from its ``head``
    (:func:`push_head`): the same bytes as hiredis's ``pack_command``.

    The lengths and a delta of 1 or -1 are looked up: formatting an integer
    costs more than the rest of the command.
    """
    b, d = str(now_ms), str(seq)  # a time in ms and a sequence number: below 256 digits
    tail = _DELTAS.get(delta) or _bulk(delta)
    size = len(member)
    lengths = _LENGTHS
    of_member = lengths[size] if size < len(lengths) else f"${size}\r\n"
    # fmt: off
    return (
        f"{head}{lengths[len(b)]}{b}\r\n{MAX_AGE_ENCODED}{lengths[len(d)]}{d}\r\n"
        f"{of_member}{member}\r\n{tail}"
    ).encode()
    # fmt: on


class PushPlan:
    """One push as the scripts to run, one per shard (see :meth:`Intake.plan_push`)."""

    __slots__ = ("calls", "deltas", "groups", "push_id", "refused", "wire")

    def __init__(
        self,
        push_id: PushId | str,
        deltas: Mapping[str, int],
        groups: Mapping[int, list[str | int]],
        refused: dict[str, int],
        calls: Sequence[tuple[Sequence[str], list]],
    ) -> None:
        self.push_id = push_id
        self.deltas = deltas
        self.groups = groups
        #: Members whose delta alone reaches the score limit: never sent.
        self.refused = refused
        #: ``(keys, args)`` of the push script, in the order of ``groups``.
        self.calls = calls
        #: The command of a push of one member, encoded for Redis (else None).
        self.wire: bytes | None = None

    def check(self, replies: list) -> None:
        """:meth:`outcome`, for a caller that needs only its exceptions."""
        calls = len(self.calls)
        if self.refused or len(replies) != calls or replies.count(1) != calls:  # not all added
            self.outcome(replies)

    def outcome(self, replies: list) -> set[int]:
        """What :meth:`Intake.push` returns or raises, given the replies to :attr:`calls`.

        The shards the push changed; :class:`StalePush` if a shard refused it as delivered
        late, :class:`ScoreLimitExceeded` (with the shards it changed) if some members
        were refused as too large.
        """
        changed: set[int] = set()
        refused = dict(self.refused)
        if self.groups:
            codes = _push_codes(self.groups, replies, self.deltas, refused)
            if 2 in codes:
                raise StalePush(str(self.push_id))
            changed = {shard for shard, code in zip(self.groups, codes, strict=True) if code == 1}
        if refused:
            raise ScoreLimitExceeded(str(self.push_id), refused, changed)
        return changed


def _push_codes(
    groups: Mapping[int, list[str | int]],
    replies: list,
    deltas: Mapping[str, int],
    refused: dict[str, int],
) -> list[int]:
    """The code of each shard's push reply, in the order of ``groups``: 1 added, 0 refused
    as a repeat, 2 delivered late, 3 over the score limit (its members go into ``refused``).

    Raises :class:`UnexpectedScriptReply` for any other reply, or a refusal naming a
    member the shard was not sent.
    """
    codes = []
    for args, reply in zip(groups.values(), replies, strict=True):
        if isinstance(reply, list) and reply and reply[0] == 3:
            members = [to_str(m) for m in reply[1:]]
            if not members or not set(members) <= set(args[::2]):
                raise UnexpectedScriptReply("PUSH_SCRIPT", replies)
            refused.update((m, int(deltas[m])) for m in members)
            codes.append(3)
        elif reply in (0, 1, 2):
            codes.append(reply)
        else:
            raise UnexpectedScriptReply("PUSH_SCRIPT", replies)
    return codes
