"""Before a process's first push: the DB records its buffer layout and every shard's epoch.

A layout is where deltas go in Redis: the key prefix, the shard count and
whether Redis is a cluster. Each process records its layout once, before
its first push (:func:`ensure_recorded`): a ``BufferLayout`` row, and
the epoch token of every shard in Redis and in the DB (``BufferEpoch``).
So the DB knows every layout that may hold deltas (a layout change is then
drained by the flush, :mod:`counters.flushing.layout`), and a Redis that loses
its data before the first flush of a prefix is seen to have lost it: the
token the DB recorded is gone (:mod:`counters.flushing.epoch`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Iterator

from django.db import connections, transaction

from counters.base.utils import to_str
from counters.buffer.cluster import ClusterClient
from counters.buffer.scripts import EPOCH_TOKEN_SCRIPT, DrainScript
from counters.buffer.store import Buffer
from counters.models import BufferEpoch, BufferLayout, describe_layout

logger = logging.getLogger(__name__)

#: Database alias -> the buffer whose layout this process recorded last there. A process
#: whose settings change records the new layout, and records an earlier one again when it
#: goes back to it: that layout may have been retired in between.
_recorded: dict[str, Buffer] = {}
_lock = threading.Lock()


def is_cluster(buffer: Buffer) -> bool:
    return isinstance(buffer.client, ClusterClient)


def ensure_token(buffer: Buffer, shard: int) -> str:
    """The shard's epoch token, set to a new random one if Redis has none."""
    script = DrainScript(buffer.client, EPOCH_TOKEN_SCRIPT)
    return to_str(script(keys=[buffer.key(shard, "epoch")], args=[secrets.token_hex(16)])) or ""


def ensure_recorded(buffer: Buffer, using: str) -> bool:
    """Record ``buffer``'s layout and shard epochs in DB ``using``, once per process and layout;
    whether they are recorded.

    Call before pushing to ``buffer``. Never raises (it runs after COMMIT): a
    failure is logged, False is returned, and the next push tries again (a
    Redis that cannot be reached fails the push too, which then goes to the
    DB directly).
    """
    if _recorded.get(using) is buffer:
        return True
    key = _layout(buffer)
    with _lock:
        last = _recorded.get(using)
        if last is not None and _layout(last) == key:  # the same layout, another buffer
            _recorded[using] = buffer
            return True
        try:
            record_layout(buffer, using)
        except Exception as exc:  # after COMMIT: the push goes on whatever this meets
            logger.warning(
                "could not record the buffer layout (%s) before pushing: %s",
                describe_layout(*key),
                exc,
            )
            return False
        _recorded[using] = buffer
        return True


def _layout(buffer: Buffer) -> tuple[str, int, bool]:
    """``(prefix, shards, cluster)``: where ``buffer``'s deltas go in Redis."""
    return (buffer.prefix, buffer.shards, is_cluster(buffer))


def record_layout(buffer: Buffer, using: str) -> BufferLayout:
    """Record ``buffer``'s layout, and each shard's epoch token, in DB ``using``.

    Invariant: before a delta enters a shard, the DB has the shard's epoch
    token (a row written now keeps the token it has: a Redis that lost it
    since is a loss the next flush reports). A retired layout that a
    process writes to again is in use again.
    """

    tokens = [ensure_token(buffer, shard) for shard in range(buffer.shards)]
    epochs = [
        BufferEpoch(prefix=buffer.prefix, shard=shard, token=token)
        for shard, token in enumerate(tokens)
    ]
    with own_transaction(using):
        BufferEpoch.objects.using(using).bulk_create(epochs, ignore_conflicts=True)
        layout, _ = BufferLayout.objects.using(using).get_or_create(
            prefix=buffer.prefix, shards=buffer.shards, cluster=is_cluster(buffer)
        )
        if layout.retired_at is not None:
            BufferLayout.objects.using(using).filter(pk=layout.pk).update(retired_at=None)
            logger.warning("buffer layout %s is written to again: in use again", layout)
    return layout


@contextlib.contextmanager
def own_transaction(using: str) -> Iterator[None]:
    """A transaction of its own, also right after the COMMIT of a manual transaction
    (autocommit off), where it is committed here."""
    conn = connections[using]
    manual = not conn.in_atomic_block and not conn.get_autocommit()
    try:
        with transaction.atomic(using=using):
            yield
    except BaseException:
        if manual:
            conn.rollback()
        raise
    if manual:
        conn.commit()
