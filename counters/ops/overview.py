"""Every declared counter with its state, for the admin's overview page.

Per counter: where it is stored, its rows, the keys pending and in flight in Redis
and the oldest pending one's lag, its quarantined deltas, whether it is backfilling,
its audit's last run and the repairs the audit made. With the flush's last run and
what schedules the flush and the audit. Redis is scanned once, shard by shard, up to
``SCAN_LIMIT`` members of each set; with Redis unreachable, the database side alone.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Count, Max
from redis import RedisError

from counters.base.registry import CounterSpec, all_specs
from counters.base.utils import to_str
from counters.buffer.store import Buffer
from counters.models import AuditRepair
from counters.ops.schedule import schedule_status
from counters.ops.status import audit_status, last_flush, shard_status
from counters.read import backfill

#: Most members of one shard's pending or in-flight set read per page view.
SCAN_LIMIT = 100_000
#: Rows above which PostgreSQL's planner estimate is shown instead of a COUNT.
ESTIMATE_ABOVE = 100_000


def _row_count(spec: CounterSpec, using: str) -> tuple[int | None, bool]:
    """(rows of the counter's table, estimated): a COUNT, or PostgreSQL's estimate if large;
    None for a counter whose model is not installed."""
    try:
        model = spec.model
    except LookupError:
        return None, False
    conn = connections[using]
    if conn.vendor == "postgresql":
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)",
                [conn.ops.quote_name(model._meta.db_table)],
            )
            row = cursor.fetchone()
        if row is not None and row[0] is not None and row[0] > ESTIMATE_ABOVE:
            return int(row[0]), True
    return model._default_manager.using(using).count(), False


def _scan(buffer: Buffer, shard: int, name: str) -> tuple[Counter[str], bool]:
    """Members of one shard's set ``name`` per counter name; True if cut at ``SCAN_LIMIT``."""
    found: Counter[str] = Counter()
    members = buffer.client.zscan_iter(buffer.key(shard, name), count=1000)
    for seen, (member, _) in enumerate(members, 1):
        found[to_str(member).partition(":")[0]] += 1
        if seen >= SCAN_LIMIT:
            return found, True
    return found, False


def buffered(buffer: Buffer) -> dict[str, dict[str, Any]]:
    """{counter: {pending, inflight, lag_seconds, quarantined, partial}} read from Redis."""
    shards = shard_status(buffer, int(time.time() * 1000))
    out: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        blank = {"pending": 0, "inflight": 0, "lag_seconds": 0.0, "quarantined": 0}
        return out.setdefault(name, {**blank, "partial": False})

    for s in shards:
        shard = s["shard"]
        for kind in ("pending", "inflight"):
            if not s[f"{kind}_keys"]:
                continue
            found, cut = _scan(buffer, shard, kind)
            for name, n in found.items():
                e = entry(name)
                e[kind] += n
                e["partial"] = e["partial"] or cut
                if kind == "pending":
                    e["lag_seconds"] = max(e["lag_seconds"], s["lag_seconds"])
    for q in buffer.quarantined():
        entry(q.counter)["quarantined"] += 1
    return out


def _repairs(using: str, recent: int = 3) -> dict[str, dict[str, Any]]:
    """{counter: {total, last_at, recent: [{key, was, truth, at}]}} of the audit's repairs."""
    rows = AuditRepair.objects.using(using)
    totals = rows.order_by().values("counter").annotate(n=Count("pk"), last=Max("repaired_at"))
    out = {t["counter"]: {"total": t["n"], "last_at": t["last"], "recent": []} for t in totals}
    for name, entry in out.items():
        for r in rows.filter(counter=name).order_by("-repaired_at")[:recent]:
            was = r.stored + r.buffered
            entry["recent"].append(
                {"key": r.key, "was": was, "truth": r.truth, "at": r.repaired_at}
            )
    return out


def overview(buffer: Buffer, using: str = DEFAULT_DB_ALIAS) -> dict[str, Any]:
    """The state of every declared counter, as plain data (see the module's docstring)."""
    try:
        redis: dict[str, Any] = {"reachable": True, "error": None}
        in_redis = buffered(buffer)
        flushed = last_flush(buffer)
    except RedisError as exc:
        redis, in_redis, flushed = {"reachable": False, "error": str(exc)[:300]}, {}, None
    states = backfill.status(using)["counters"]
    audits = audit_status(using)["counters"]
    repairs = _repairs(using)
    rows = []
    for spec in sorted(all_specs(), key=lambda s: s.name):
        count, estimated = _row_count(spec, using)
        zero = {"pending": 0, "inflight": 0, "lag_seconds": 0.0, "quarantined": 0}
        rows.append(
            {
                "name": spec.name,
                "stored_in": f"{spec.model_label}.{spec.value_field}",
                "rows": count,
                "rows_estimated": estimated,
                "buffer": in_redis.get(spec.name, {**zero, "partial": False})
                if redis["reachable"]
                else None,
                "backfilling": states.get(spec.name, {}).get("state") == backfill.BACKFILLING,
                "audited": spec.name in audits,
                "last_audit_at": (audits.get(spec.name) or {}).get("last_run_at"),
                "repairs": repairs.get(spec.name, {"total": 0, "last_at": None, "recent": []}),
            }
        )
    return {
        "prefix": buffer.prefix,
        "redis": redis,
        "last_flush": flushed,
        "schedule": schedule_status(),
        "counters": rows,
    }
