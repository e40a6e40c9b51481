"""Detect Redis data loss: an epoch token per shard, remembered in the DB."""

from __future__ import annotations

import logging
import secrets

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from .buffer import Buffer
from .models import BufferEpoch

logger = logging.getLogger(__name__)

LOST_MESSAGE = (
    "Redis lost the buffer of shard %s under prefix %r (its epoch marker is gone: "
    "Redis restarted without persistence, was flushed, or failed over to an empty "
    "replica). Deltas buffered there before now are lost, so some counters are wrong "
    "until `manage.py notification_rebuild_counters` runs (COUNTERS_AUTO_REBUILD=1 "
    "does it automatically). Enable appendonly in Redis to avoid this."
)


def check_epoch(buffer: Buffer, shard: int, using: str = "default") -> bool:
    """True if shard ``shard`` lost its data since the last check. Call under its lease."""
    key = buffer.key(shard, "epoch")
    token = buffer.client.get(key)
    token = token.decode() if isinstance(token, bytes) else token
    epochs = BufferEpoch.objects.using(using)
    row = epochs.filter(prefix=buffer.prefix, shard=shard).first()
    if row is not None and token == row.token:
        return False
    if token is None:
        new = secrets.token_hex(16)
        if not buffer.client.set(key, new, nx=True):
            new = buffer.client.get(key).decode()
        token = new
    lost = row is not None
    with transaction.atomic(using=using):
        if row is None:
            epochs.get_or_create(prefix=buffer.prefix, shard=shard, defaults={"token": token})
        else:
            epochs.filter(pk=row.pk).update(
                token=token,
                started_at=timezone.now(),
                losses=F("losses") + 1,
                last_loss_at=timezone.now(),
            )
    if lost:
        logger.error(LOST_MESSAGE, shard, buffer.prefix)
    return lost
