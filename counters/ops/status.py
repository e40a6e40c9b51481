"""What the pipeline is doing now: per-shard backlog, batches in flight, leases, epochs,
failed shards, quarantined deltas, the audit and new counters still backfilling. With Redis
unreachable, the DB side alone."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.db.models import Count, Max, Sum
from django.utils import timezone

from counters.base import conf
from counters.base.utils import to_str
from counters.buffer.store import Buffer
from counters.flushing import layout, quarantine
from counters.flushing.epoch import REBUILD_COMMAND
from counters.flushing.waits import blocked_flushes
from counters.models import AuditCursor, AuditRepair, BufferEpoch, FlushBatch
from counters.ops.fanout import FLUSHED_AT, last_run, run_key
from counters.ops.schedule import schedule_status
from counters.read import backfill
from counters.verify.audit import audited_specs
from counters.write import sender
from counters.write.negatives import queue_key
from counters.write.outbox import summary as outbox_summary


def shard_status(buffer: Buffer, now_ms: int) -> list[dict[str, Any]]:
    pipe = buffer.client.pipeline(transaction=False)
    for shard in range(buffer.shards):
        pipe.zcard(buffer.key(shard, "pending"))
        pipe.get(buffer.key(shard, "since"))
        pipe.hgetall(buffer.key(shard, "batch"))
        pipe.zcard(buffer.key(shard, "inflight"))
        pipe.get(buffer.key(shard, "lease"))
        pipe.pttl(buffer.key(shard, "lease"))
        pipe.get(buffer.key(shard, "epoch"))
        pipe.get(buffer.key(shard, "seq"))
    replies = pipe.execute()
    shards = []
    for shard in range(buffer.shards):
        pending, since, batch, inflight, lease, lease_ttl, epoch, seq = replies[
            8 * shard : 8 * shard + 8
        ]
        batch = {to_str(k): to_str(v) for k, v in batch.items()}
        shards.append(
            {
                "shard": shard,
                "pending_keys": pending,
                # Only what is pending lags: an empty set's mark is left over, not a lag.
                "lag_seconds": (
                    round((now_ms - int(since)) / 1000, 3) if since and pending else 0.0
                ),
                "inflight_batch": batch.get("id"),
                "inflight_keys": inflight,
                "inflight_age_seconds": (
                    round((now_ms - int(batch["ts"])) / 1000, 3) if batch.get("ts") else None
                ),
                "lease_holder": (to_str(lease) or "")[:8] or None,
                "lease_expires_in": round(lease_ttl / 1000, 3) if lease_ttl > 0 else None,
                "epoch": to_str(epoch),
                "seq": int(seq or 0),
            }
        )
    return shards


def last_flush(buffer: Buffer) -> dict[str, Any] | None:
    """The newest flush: a whole one (cron, ``counters.flush()``) or a parallel run.

    A parallel run (``COUNTERS_FLUSH_PARALLELISM`` > 1) is the sum of its
    dispatcher and of the parts that have reported so far, with
    ``parallel: {"run", "parts", "reported", "shards"}``; ``parallel`` is None
    for a whole flush. None if no flush was recorded.
    """
    raw = buffer.client.hgetall(f"{buffer.prefix}:last_flush")
    whole = {to_str(k): json.loads(v) for k, v in raw.items()} if raw else None
    if whole is not None:
        whole["parallel"] = None
    run = last_run(buffer)
    newest = max(
        (data for data in (whole, run) if data is not None),
        key=lambda data: data["at"],
        default=None,
    )
    if newest is None:
        return None
    newest["age_seconds"] = round(time.time() - newest.pop("at"), 3)
    return newest


def flush_clock(buffer: Buffer) -> tuple[float, int] | None:
    """(Unix time, failed shards) of the newest flush of shards, for ``/metrics``.

    The same whether one process flushes or N tasks do: a whole flush (cron,
    ``counters.flush()``) or a part of a parallel run, whichever recorded its
    result last. A dispatch alone flushes no shard and does not count. The
    failed shards of a parallel run are those of its parts reported so far.
    None if no flush was ever recorded.
    """
    at, failed = buffer.client.hmget(f"{buffer.prefix}:last_flush", ["at", "failed_shards"])
    whole = None
    if at is not None:
        whole = (float(json.loads(to_str(at))), len(json.loads(to_str(failed) or "{}")))
    flushed_at = buffer.client.hget(run_key(buffer), FLUSHED_AT)
    part = None
    if flushed_at is not None:
        run = last_run(buffer)
        part = (float(to_str(flushed_at)), len(run["failed_shards"]) if run else 0)
    return max((c for c in (whole, part) if c is not None), key=lambda c: c[0], default=None)


def ledger_status(using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    rows = FlushBatch.objects.using(using)
    by_kind: dict[str, dict[str, Any]] = {
        row["kind"]: dict(row)
        for row in rows.values("kind").annotate(
            batches=Count("pk"), dropped=Sum("dropped"), last=Max("applied_at")
        )
    }
    fallback: dict[str, Any] = by_kind.get(FlushBatch.Kind.FALLBACK, {})
    flushed: dict[str, Any] = by_kind.get(FlushBatch.Kind.FLUSH, {})
    return {
        "batches_in_ledger": flushed.get("batches", 0),
        "last_batch_at": flushed["last"].isoformat() if flushed.get("last") else None,
        "fallback_writes": fallback.get("batches", 0),
        "last_fallback_at": fallback["last"].isoformat() if fallback.get("last") else None,
        "dropped_keys": (flushed.get("dropped") or 0) + (fallback.get("dropped") or 0),
        "unsettled_fallbacks": rows.filter(unsettled__isnull=False).count(),
    }


def epoch_status(
    buffer: Buffer, shards: list[dict[str, Any]], using: str = DEFAULT_DB_ALIAS
) -> dict:
    """Losses of Redis data, and whether counters need a rebuild because of them.

    ``state`` is ``ok`` (never lost), ``lost`` (Redis lost data or went back in
    time since the last flush looked), ``rebuild_needed`` (a flush saw a loss
    and no full rebuild has completed since) or ``repaired`` (every loss so far
    was followed by a completed full rebuild).
    """
    rows = {e.shard: e for e in BufferEpoch.objects.using(using).filter(prefix=buffer.prefix)}
    unchecked = [
        s["shard"]
        for s in shards
        if s["shard"] in rows
        and (s["epoch"] != rows[s["shard"]].token or s["seq"] < rows[s["shard"]].seq)
    ]
    losses = sum(e.losses for e in rows.values())
    last = max((e.last_loss_at for e in rows.values() if e.last_loss_at), default=None)
    since = min(
        (e.rebuild_needed_since for e in rows.values() if e.rebuild_needed_since), default=None
    )
    if unchecked:
        state = "lost"  # Redis lost data since the last flush saw it
    elif since is not None:
        state = "rebuild_needed"
    elif losses:
        state = "repaired"
    else:
        state = "ok"
    return {
        "state": state,
        "shards_lost_since_last_flush": unchecked,
        "losses": losses,
        "last_loss_at": last.isoformat() if last else None,
        "rebuild_needed": bool(unchecked) or since is not None,
        "rebuild_needed_since": since.isoformat() if since else None,
        "rebuild_command": REBUILD_COMMAND,
    }


def audit_status(using: str = DEFAULT_DB_ALIAS, recent: int = 5) -> dict[str, Any]:
    """What ``counters_status`` shows of the audit: settings, cursors and repairs (DB only)."""
    now = timezone.now()
    cursors = {c.counter: c for c in AuditCursor.objects.using(using)}
    counters: dict[str, dict[str, Any]] = {}
    for spec in audited_specs():
        c = cursors.get(spec.name)
        counters[spec.name] = {
            "position": c.after if c else None,
            "checked_this_sweep": c.checked if c else 0,
            "sweeps": c.sweeps if c else 0,
            "last_run_at": _iso(c.last_run_at) if c else None,
            "last_sweep_at": _iso(c.last_sweep_at) if c else None,
            "last_sweep_seconds": c.last_sweep_seconds if c else None,
        }
    repairs = AuditRepair.objects.using(using)
    day = repairs.filter(repaired_at__gte=now - timedelta(days=1))
    totals = repairs.aggregate(n=Count("pk"), last=Max("repaired_at"))
    return {
        "interval": conf.audit_interval(),
        "slice": conf.audit_slice(),
        "counters": counters,
        "repairs": {
            "total": totals["n"],
            "last_24h": day.count(),
            "last_at": _iso(totals["last"]),
            "recent": [
                {
                    "counter": r.counter,
                    "key": r.key,
                    "stored": r.stored,
                    "buffered": r.buffered,
                    "truth": r.truth,
                    "at": _iso(r.repaired_at),
                }
                for r in repairs[:recent]
            ],
        },
    }


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def gather(buffer: Buffer, using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    """Everything ``counters_status`` shows, as plain data."""
    now_ms = int(time.time() * 1000)
    shards = shard_status(buffer, now_ms)
    quarantined = buffer.quarantined()
    return {
        "prefix": buffer.prefix,
        "redis": {"reachable": True, "error": None},
        "shards": shards,
        "totals": {
            "pending_keys": sum(s["pending_keys"] for s in shards),
            "inflight_batches": sum(1 for s in shards if s["inflight_batch"]),
            "max_lag_seconds": max((s["lag_seconds"] for s in shards), default=0.0),
        },
        "last_flush": last_flush(buffer),
        "ledger": ledger_status(using),
        "epoch": epoch_status(buffer, shards, using),
        "layouts": layout.status(buffer, using),
        "repair_queue": int(buffer.client.scard(queue_key(buffer))),
        "quarantine": {
            "deltas": len(quarantined),
            "counters": quarantine.by_counter(quarantined),
        },
        "audit": audit_status(using),
        "schedule": schedule_status(),
        "backfill": backfill.status(using),
        "outbox": outbox_summary(using),
        "write_path": sender.describe_mode(),
        "blocked_flushes": blocked_flushes(using),
    }


def gather_without_redis(
    buffer: Buffer, error: str, using: str = DEFAULT_DB_ALIAS
) -> dict[str, Any]:
    """What the DB alone tells when Redis cannot be reached: ledger, direct writes, epochs.

    Every write goes to the DB directly while Redis is down, so the fallback
    writes show what the write path is doing; the epochs show a data loss
    seen before.
    """
    epoch = epoch_status(buffer, [], using)
    return {
        "prefix": buffer.prefix,
        "redis": {"reachable": False, "error": error},
        "ledger": ledger_status(using),
        "epoch": epoch,
        "layouts": layout.status(buffer, using, live=False),
        "audit": audit_status(using),
        "schedule": schedule_status(),
        "backfill": backfill.status(using),
        "outbox": outbox_summary(using),
        "write_path": sender.describe_mode(),
        "blocked_flushes": blocked_flushes(using),
    }
