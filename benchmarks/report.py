"""Targets, the machine, and the results as a table."""

from __future__ import annotations

import os
import platform
import sqlite3
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import django
from django.db import connection

from .writes_report import load_text as _load
from .writes_report import writes_table

if TYPE_CHECKING:
    from .internals import RedisClient


@dataclass(frozen=True)
class Target:
    name: str
    path: tuple[str, ...]
    op: str
    threshold: float
    #: The same figure of the least program with the same guarantees (a floor mode), if any:
    #: a target it misses too is out of reach in that run.
    floor: tuple[str, ...] | None = None
    #: The figure that ``path``'s (and ``floor``'s) is divided by, if any.
    per: tuple[str, ...] | None = None

    def check(self, results: dict[str, Any]) -> dict[str, Any] | None:
        value = self._value(results, self.path)
        if value is None:
            return None
        checked = {
            "name": self.name,
            "value": value,
            "op": self.op,
            "threshold": self.threshold,
            "met": self._meets(value),
        }
        floor = self._value(results, self.floor) if self.floor else None
        if self.floor and floor is not None:
            checked |= {
                "floor": self.floor[-1],
                "floor_value": floor,
                "floor_met": self._meets(floor),
            }
        return checked

    def _value(self, results: dict[str, Any], path: tuple[str, ...]) -> Any:
        value = _dig(results, path)
        if self.per is None or value is None:
            return value
        per = _dig(results, self.per)
        return round(value / per, 3) if per else None

    def _meets(self, value: float) -> bool:
        return value >= self.threshold if self.op == ">=" else value <= self.threshold


def _dig(results: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = results
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _write_target(name: str, workload: str, ratio: str, threshold: float, floor: str) -> Target:
    """A target on the writes section's ``ratio`` in ``workload``, beside ``floor``'s."""
    return Target(
        f"{name} {workload}",
        ("writes", workload, ratio),
        ">=",
        threshold,
        ("writes", workload, floor),
    )


TARGETS = (
    _write_target("tally/off", "spread", "tally_off", 0.9, "floor_push_off"),
    _write_target("tally/off", "hot", "tally_off", 0.9, "floor_push_off"),
    _write_target("tally/trigger", "spread", "tally_trigger", 1.0, "floor_push_trigger"),
    _write_target("tally/trigger", "hot", "tally_trigger", 1.4, "floor_push_trigger"),
    *(
        Target(
            f"tally {label}/off {workload}",
            ("writes", workload, f"tally_{figure}"),
            "<=",
            1.05,
            ("writes", workload, f"floor_push_{figure}"),
            per=("writes", workload, f"off_{figure}"),
        )
        for label, figure in (("backend CPU", "backend_cpu_us"), ("WAL", "wal_bytes"))
        for workload in ("spread", "hot")
    ),
    _write_target("durable/off", "spread", "durable_off", 0.75, "floor_durable_off"),
    _write_target("durable/off", "hot", "durable_off", 0.75, "floor_durable_off"),
    Target("tally/naive hot", ("writes", "hot", "tally_naive"), ">=", 3.0),
    Target("flush/raw SQL", ("flush", "flush_raw"), ">=", 0.8),
    Target("flusher RSS growth (MB)", ("memory", "growth_mb"), "<=", 50.0),
)


def targets(results: dict) -> list[dict]:
    return [checked for t in TARGETS if (checked := t.check(results)) is not None]


def _memory_mb() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def _database_version() -> str:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            return f"PostgreSQL {cursor.fetchone()[0]}"
    if connection.vendor == "sqlite":
        return f"SQLite {sqlite3.sqlite_version}"
    if connection.vendor == "mysql":
        version = ".".join(str(part) for part in cast(Any, connection).mysql_version)
        return f"{connection.display_name} {version}"
    return connection.display_name


def _redis_version(info: dict) -> str:
    """``redis_version`` of an INFO reply, or of the first node's (a cluster client)."""
    if "redis_version" in info:
        return str(info["redis_version"])
    for value in info.values():
        if isinstance(value, dict) and "redis_version" in value:
            return str(value["redis_version"])
    return "unknown"


def redis_nodes(url: str) -> list[str]:
    """``host:port`` of each comma-separated Redis URL (no credentials, no database)."""
    nodes = []
    for part in url.split(","):
        parsed = urlsplit(part.strip())
        nodes.append(parsed.path if parsed.scheme == "unix" else f"{parsed.hostname}:{parsed.port}")
    return nodes


def machine(client: RedisClient) -> dict:
    return {
        "nproc": os.cpu_count(),
        "memory_mb": _memory_mb(),
        "database": _database_version(),
        "redis": f"Redis {_redis_version(client.info('server'))}",
        "python": platform.python_version(),
        "django": django.get_version(),
    }


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _async_lines(a: dict) -> list[str]:
    designs = a["designs"]
    counts = list(next(iter(designs.values())))
    lines = [
        f"async reads: {a['keys']} keys, {a['reads']:,} reads a run, median of {a['rounds']} "
        f"rounds, exact {a['exact']}   (load {_load(a['load'])})",
        f"{'design':<8}" + "".join(f"{c + ' tasks: reads/s, CPU us/read':>36}" for c in counts),
    ]
    for name, by_count in designs.items():
        cells = [f"{f['reads_per_s']:>24,}{f['cpu_us_per_read']:>12,}" for f in by_count.values()]
        lines.append(f"{name:<8}" + "".join(cells))
    return lines


def render(results: dict) -> str:
    m = results["machine"]
    cfg = results["config"]
    lines = [
        f"counters_bench: {m['database']}, {m['redis']}, {m['nproc']} CPUs, "
        f"{m['memory_mb']} MB RAM, Python {m['python']}, Django {m['django']}",
    ]
    if results["debug"]:
        lines.append("note: DEBUG is on, so every query is logged; publish with DEBUG=0")
    if "writes" in results:
        lines += ["", *writes_table(results["writes"], cfg)]
    if "flush" in results:
        f = results["flush"]
        lines += [
            "",
            f"flush: {f['keys']:,} pending keys, batches of {f['batch_size']}: "
            f"flush {f['flush_keys_per_s']:,.0f} keys/s, raw SQL {f['raw_keys_per_s']:,.0f} "
            f"keys/s, flush/raw {f['flush_raw']:.2f}; raw SQL in key order "
            f"{f.get('raw_sequential_keys_per_s', 0):,.0f} keys/s, flush/that "
            f"{f.get('flush_raw_sequential', 0):.2f}   (load {_load(f['load'])})",
        ]
    if "parallel" in results:
        p = results["parallel"]
        redis = results.get("redis") or {}
        where = (
            f"Redis Cluster of {len(redis.get('nodes', []))} listed nodes"
            if redis.get("cluster")
            else "one Redis"
        )
        lines += [
            "",
            f"parallel flush: {p['keys']:,} pending keys, {p['shards']} shards, batches of "
            f"{p['batch_size']}, {where}, median of {p['rounds']} rounds   "
            f"(load {_load(p['load'])})",
            f"{'flushers':<10}{'keys/s':>10}{'speed-up':>10}",
        ]
        for n, figures in p["workers"].items():
            lines.append(f"{n:<10}{figures['keys_per_s']:>10.0f}{p['speedup'][n]:>10.2f}")
    if "reads" in results:
        r = results["reads"]
        lines += [
            "",
            f"reads: {r['unread']:,} unread among {r['notifications']:,}: "
            f"get_count {r['get_count_ms']:.3f} ms, COUNT(*) {r['count_ms']:.3f} ms "
            f"(median of {r['samples']}), COUNT/get_count {r['count_get_count']:.1f}, "
            f"exact {r['exact']}   (load {_load(r['load'])})",
        ]
    if "async" in results:
        lines += ["", *_async_lines(results["async"])]
    if "memory" in results:
        mem = results["memory"]
        small, large = mem["small"], mem["large"]
        lines += [
            "",
            f"memory: flusher peak RSS {small['peak_mb']:.1f} MB with {small['keys']:,} keys, "
            f"{large['peak_mb']:.1f} MB with {large['keys']:,} keys, growth "
            f"{mem['growth_mb']:.1f} MB   (load {_load(mem['load'])})",
        ]
    if "idempotency" in results:
        idem = results["idempotency"]
        lines += [
            "",
            f"idempotency: Redis keys and bytes of deduplication, {idem['threads']} threads, "
            f"{idem['shards']} shards, one delta a push   (load {_load(idem['load'])})",
            f"{'pushes':>9} {'scheme':<7}{'keys':>9}{'bytes':>13}{'bytes/push':>11}"
            f"{'freed':>13}{'pushes/s':>10}",
        ]
        for size, by_scheme in idem["runs"].items():
            for name, run in by_scheme.items():
                lines.append(
                    f"{int(size):>9,} {name:<7}{run['idempotency_keys']:>9,}"
                    f"{run['idempotency_bytes']:>13,}{run['bytes_per_push']:>11.1f}"
                    f"{run['used_memory_freed']:>13,}"
                    f"{run['pushes_per_s']:>10,}"
                )
        lines.append(
            f"keys x3 pushes: old x{idem['old_growth']}, new x{idem['new_growth']}; new keys "
            f"<= shards x threads ({idem['new_keys_limit']}): {idem['new_flat']}; freed: INFO "
            "used_memory given back by deleting the run's keys (pending sets included)"
        )
    if results["targets"]:
        lines += [
            "",
            "targets (floor: the same figure of the floor mode with the same guarantees, "
            "measured in the same rounds; a target it misses too is out of reach in this run):",
        ]
        for t in results["targets"]:
            line = (
                f"  {t['name']:<30}{t['value']:>9.2f} {t['op']} {t['threshold']:<6g}"
                f"{'met' if t['met'] else 'NOT MET':<9}"
            )
            if "floor" in t:
                verdict = "met" if t["floor_met"] else "NOT MET"
                line += f"  floor {t['floor']} {t['floor_value']:.2f}: {verdict}"
            lines.append(line.rstrip())
    return "\n".join(lines)
