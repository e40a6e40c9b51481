"""Show the state of the counter pipeline: backlog, lag, batches in flight, leases, epochs."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError
from redis import RedisError

from counters import api, conf
from counters.status import gather


def _fmt(value, suffix: str = "") -> str:
    return "-" if value is None else f"{value}{suffix}"


class Command(BaseCommand):
    help = "Show pending keys, lag, in-flight batches, leases, last flush, fallbacks and epochs."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the status as JSON.")
        parser.add_argument("--database", default="default", help="Database alias.")

    def handle(self, *args, **options) -> None:
        try:
            status = gather(api.get_buffer(options["database"]), options["database"])
        except RedisError as exc:
            raise CommandError(f"Redis unreachable at {conf.redis_url()}: {exc}") from exc
        except DatabaseError as exc:
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CommandError(f"database error: {line}") from exc
        if options["json"]:
            self.stdout.write(json.dumps(status, indent=2))
            return
        self.stdout.write(self.render(status))

    def render(self, status: dict) -> str:
        epoch, ledger, totals = status["epoch"], status["ledger"], status["totals"]
        lines = [
            f"prefix {status['prefix']!r}: {totals['pending_keys']} pending keys, "
            f"{totals['inflight_batches']} batches in flight, "
            f"max lag {totals['max_lag_seconds']}s",
            f"epoch: {epoch['state']} (losses {epoch['losses']}, "
            f"last {_fmt(epoch['last_loss_at'])}); "
            f"keys queued for repair: {status['repair_queue']}",
        ]
        if epoch["rebuild_needed"]:
            since = epoch["rebuild_needed_since"] or "now (no flush has seen it yet)"
            lines.append(
                f"REBUILD NEEDED since {since}: Redis lost buffered deltas, so some counts are "
                f"wrong until a full rebuild completes: run `{epoch['rebuild_command']}`"
            )
        last = status["last_flush"]
        if last is None:
            lines.append("last flush: never")
        else:
            lines.append(
                f"last flush: {last['age_seconds']}s ago, {last['batches']} batches, "
                f"{last['keys']} keys, {last['deltas']} deltas in {last['seconds']:.3f}s"
                + (" (time budget reached)" if last["incomplete"] else "")
            )
        lines.append(
            f"ledger: {ledger['batches_in_ledger']} batches, last {_fmt(ledger['last_batch_at'])};"
            f" fallback DB writes {ledger['fallback_writes']}"
            f" (last {_fmt(ledger['last_fallback_at'])}); dropped keys {ledger['dropped_keys']}"
        )
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
