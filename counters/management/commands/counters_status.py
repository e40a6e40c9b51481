"""Show the state of the counter pipeline: backlog, lag, batches in flight, leases, epochs,
failed shards and quarantined deltas.

Exit status: 0 with the status; 2 (``REDIS_UNREACHABLE``) when Redis cannot be
reached or answers with an error reply (``WRONGTYPE`` ...; the line says
which): what the DB tells (ledger, direct writes, epochs, rebuild needed) is
still printed; 1 with one readable line when the database fails, and with
``--json`` an object with ``"error"`` on stdout all the same.
"""

from __future__ import annotations

import json
import sys

from django.db import DEFAULT_DB_ALIAS, DatabaseError
from redis import RedisError

from counters.base import conf
from counters.base.exceptions import BufferUnavailable
from counters.base.utils import first_line
from counters.client import get_buffer
from counters.management.commands._failures import OneLineFailures, failure, failure_data
from counters.ops.status import gather, gather_without_redis

REDIS_UNREACHABLE = 2


def _fmt(value, suffix: str = "") -> str:
    return "-" if value is None else f"{value}{suffix}"


class Command(OneLineFailures):
    help = (
        "Show pending keys, lag, in-flight batches, leases, last flush, failed shards, "
        "quarantined deltas, fallbacks, epochs and the audit."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the status as JSON.")
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, help="Database alias.")

    def handle(self, *args, **options) -> None:
        using = options["database"]
        buffer = get_buffer(using)
        try:
            try:
                status = gather(buffer, using)
            except RedisError as exc:
                error = first_line(BufferUnavailable(conf.redis_where(), exc))
                status = gather_without_redis(buffer, error[:500], using)
        except Exception as exc:
            if options["json"]:  # JSON always: the error, and which side failed
                data = {"prefix": buffer.prefix, **failure_data(exc)}
                if isinstance(exc, DatabaseError):
                    data["database"] = {"alias": using, "reachable": False}
                self.stdout.write(json.dumps(data, indent=2))
            raise failure("counters_status", exc) from exc
        if options["json"]:
            self.stdout.write(json.dumps(status, indent=2))
        elif status["redis"]["reachable"]:
            self.stdout.write(self.render(status))
        else:
            self.stdout.write(self.render_without_redis(status))
        if not status["redis"]["reachable"]:
            self.stderr.write(f"{status['redis']['error']}; showing what the database tells")
            sys.exit(REDIS_UNREACHABLE)

    def render(self, status: dict) -> str:
        epoch, totals = status["epoch"], status["totals"]
        lines = [
            f"prefix {status['prefix']!r}: {totals['pending_keys']} pending keys, "
            f"{totals['inflight_batches']} batches in flight, "
            f"max lag {totals['max_lag_seconds']}s",
            f"epoch: {epoch['state']} (losses {epoch['losses']}, "
            f"last {_fmt(epoch['last_loss_at'])}); "
            f"keys queued for repair: {status['repair_queue']}",
        ]
        lines.append(self.write_path_line(status["write_path"]))
        lines += self.layout_lines(status["layouts"])
        lines += self.rebuild_lines(epoch)
        lines += self.backfill_lines(status["backfill"])
        last = status["last_flush"]
        if last is None:
            lines.append("last flush: never")
        else:
            parallel = last.get("parallel")
            lines.append(
                f"last flush: {last['age_seconds']}s ago, {last['batches']} batches, "
                f"{last['keys']} keys, {last['deltas']} deltas in {last['seconds']:.3f}s"
                + (" (time budget reached)" if last["incomplete"] else "")
                + (
                    f" (parallel run {parallel['run']}: {parallel['reported']} of "
                    f"{parallel['parts']} parts reported)"
                    if parallel
                    else ""
                )
            )
            for shard, error in sorted(
                (last.get("failed_shards") or {}).items(), key=lambda item: int(item[0])
            ):
                lines.append(f"FAILED shard {shard} in the last flush: {error}")
        lines += self.blocked_lines(status["blocked_flushes"])
        lines += self.quarantine_lines(status["quarantine"])
        lines.append(self.ledger_line(status["ledger"]))
        lines.append(self.flush_schedule_line(status["schedule"]["flush"]))
        lines += self.audit_lines(status["audit"], status["schedule"]["audit"])
        lines.append(self.outbox_line(status["outbox"]))
        lines.append("shard  pending  lag(s)  in-flight batch (keys, age s)        lease (expires)")
        for s in status["shards"]:
            inflight = (
                f"{s['inflight_batch']} ({s['inflight_keys']}, {s['inflight_age_seconds']})"
                if s["inflight_batch"]
                else "-"
            )
            lease = f"{s['lease_holder']} ({s['lease_expires_in']}s)" if s["lease_holder"] else "-"
            lines.append(
                f"{s['shard']:>5}  {s['pending_keys']:>7}  {s['lag_seconds']:>6}  "
                f"{inflight:<36}  {lease}"
            )
        return "\n".join(lines)

    def render_without_redis(self, status: dict) -> str:
        epoch = status["epoch"]
        lines = [
            f"prefix {status['prefix']!r}: {self.redis_label(status['redis']['error'])} "
            f"({status['redis']['error']}); "
            "showing what the database tells. Writes go to the DB directly meanwhile.",
            f"epoch: {epoch['state']} (losses {epoch['losses']}, "
            f"last {_fmt(epoch['last_loss_at'])})",
            self.write_path_line(status["write_path"]),
        ]
        lines += self.layout_lines(status["layouts"])
        lines += self.rebuild_lines(epoch)
        lines += self.backfill_lines(status["backfill"])
        lines += self.blocked_lines(status["blocked_flushes"])
        lines.append(self.ledger_line(status["ledger"]))
        lines.append(f"unsettled direct writes: {status['ledger']['unsettled_fallbacks']}")
        lines.append(self.flush_schedule_line(status["schedule"]["flush"]))
        lines += self.audit_lines(status["audit"], status["schedule"]["audit"])
        lines.append(self.outbox_line(status["outbox"]))
        return "\n".join(lines)

    @staticmethod
    def redis_label(error: str) -> str:
        """REDIS DOWN when it cannot be reached; REDIS ERROR REPLY when it answered with one."""
        return "REDIS ERROR REPLY" if "answered with an error reply" in error else "REDIS DOWN"

    @staticmethod
    def outbox_line(outbox: dict) -> str:
        """Durable mode and the outbox: rows waiting for Redis, the oldest one's age."""
        mode = "durable" if outbox["durable"] else "buffered (COUNTERS_DURABLE off)"
        return f"outbox: {outbox['rows']} rows, oldest {outbox['oldest_age']:.1f}s; mode {mode}"

    @staticmethod
    def write_path_line(write_path: dict) -> str:
        """How committed deltas reach Redis, and what that mode trades."""
        if write_path["mode"] == "batched":
            return (
                f"write path: pushes written {write_path['write_batch']} at a time outside a "
                f"request; trades: {write_path['trades']}"
            )
        if write_path["mode"] != "sender":
            return "write path: each COMMIT pushes its deltas before returning"
        return (
            f"write path: per-process sender, every {write_path['send_delay_ms']:g} ms or "
            f"{write_path['send_batch']} commits; trades: {write_path['trades']}"
        )

    @staticmethod
    def flush_schedule_line(flush: dict) -> str:
        """What runs the flush: Celery beat's entries, or nothing this project can see."""
        if flush["beat"]:
            return f"flush: {', '.join(flush['beat'])} by Celery beat"
        return "flush: not scheduled by Celery beat; run `manage.py counters_flush` from cron"

    @staticmethod
    def audit_lines(audit: dict, schedule: dict) -> list[str]:
        """The audit's schedule, where each counter's sweep is, and its repairs."""
        if not audit["interval"]:
            every = "periodic audit off (COUNTERS_AUDIT_INTERVAL)"
        elif schedule["beat"]:
            every = f"{', '.join(schedule['beat'])} by Celery beat"
        else:
            every = "not scheduled by Celery beat; run `manage.py counters_audit` from cron"
        repairs = audit["repairs"]
        lines = [
            f"audit: {every}, {audit['slice']} keys per counter a run; repairs "
            f"{repairs['total']} ({repairs['last_24h']} in 24 h, last {_fmt(repairs['last_at'])})"
        ]
        for name, c in audit["counters"].items():
            at = f"after key {c['position']}" if c["position"] is not None else "at the start"
            last = (
                f"last sweep done {c['last_sweep_at']} in {c['last_sweep_seconds']:.0f}s"
                if c["last_sweep_at"] and c["last_sweep_seconds"] is not None
                else "no sweep done yet"
            )
            lines.append(
                f"  {name}: sweep {c['sweeps'] + 1} {at} ({c['checked_this_sweep']} keys so far), "
                f"{last}"
            )
        for r in repairs["recent"]:
            lines.append(
                f"  repaired {r['counter']} {r['key']} at {r['at']}: stored {r['stored']} + "
                f"buffered {r['buffered']}, truth {r['truth']} "
                f"({r['truth'] - r['stored'] - r['buffered']:+d})"
            )
        return lines

    @staticmethod
    def layout_lines(layouts: dict) -> list[str]:
        """Buffer layouts whose deltas are not drained yet (after a settings change)."""
        return [
            f"LAYOUT CHANGE NOT DRAINED: deltas of {other} are not counted by reads, and "
            f"repairs wait, until a flush drains them (layout in use: {layouts['current']})"
            for other in layouts["not_drained"]
        ]

    @staticmethod
    def rebuild_lines(epoch: dict) -> list[str]:
        if not epoch["rebuild_needed"]:
            return []
        since = epoch["rebuild_needed_since"] or "now (no flush has seen it yet)"
        return [
            f"REBUILD NEEDED since {since}: Redis lost buffered deltas, so some counts are "
            f"wrong until a full rebuild completes: run `{epoch['rebuild_command']}`"
        ]

    @staticmethod
    def backfill_lines(backfill: dict) -> list[str]:
        """One line per new counter over existing rows whose first full rebuild is not done."""
        return [
            f"BACKFILLING {name} (new over existing rows, seen "
            f"{_fmt(backfill['counters'][name]['first_seen_at'])}): reads return its truth "
            "(SQL) until a full rebuild of it completes; the flush starts one"
            for name in backfill["backfilling"]
        ]

    @staticmethod
    def ledger_line(ledger: dict) -> str:
        return (
            f"ledger: {ledger['batches_in_ledger']} batches, last {_fmt(ledger['last_batch_at'])};"
            f" fallback DB writes {ledger['fallback_writes']}"
            f" (last {_fmt(ledger['last_fallback_at'])}); dropped keys {ledger['dropped_keys']}"
        )

    @staticmethod
    def blocked_lines(blocked: list[dict]) -> list[str]:
        """A flush waiting on a lock, and the session that holds it (PostgreSQL, MySQL)."""
        lines = []
        for wait in blocked:
            by = wait["blocked_by"]
            lines.append(
                f"BLOCKED FLUSH: pid {wait['pid']} ({wait['application'] or '-'}) has waited "
                f"{wait['waiting_seconds']:.1f}s for a lock held by pid {by['pid']} "
                f"({by['application'] or '-'}, {by['state'] or '-'}, client "
                f"{by['client'] or 'local'}, in its transaction for "
                f"{by['transaction_seconds']:.1f}s): {by['query'][:100]}"
            )
        if lines:
            lines.append(
                "  a frozen flusher's session ends after its idle-in-transaction timeout; "
                "or end it: SELECT pg_terminate_backend(<pid>) on PostgreSQL, KILL <pid> on "
                "MySQL/MariaDB"
            )
        return lines

    @staticmethod
    def quarantine_lines(quarantine: dict) -> list[str]:
        if not quarantine["deltas"]:
            return []
        lines = [
            f"QUARANTINED: {quarantine['deltas']} deltas could not be applied (reads still "
            "count them); fix the cause, then run `manage.py counters_flush "
            "--retry-quarantined` (or --discard-quarantined to drop them for good)"
        ]
        for name, group in quarantine["counters"].items():
            lines.append(f"  {name}: {group['count']} deltas, sum {group['sum']:+d}")
            for example in group["examples"]:
                lines.append(f"    {example['member']} ({example['delta']:+d}): {example['error']}")
        return lines
