"""What a write run costs besides its time, sampled right before and right after it.

- the Redis server: ``INFO cpu`` (every run) and ``INFO commandstats``;
- the PostgreSQL backends serving the writers' connections: their CPU time,
  ``utime + stime`` of ``/proc/<pid>/stat``, when the server runs on this
  machine (the writers report ``pg_backend_pid()``); otherwise none;
- the WAL PostgreSQL wrote: ``pg_current_wal_lsn()`` before and after.

The writers' own CPU time is measured in the writers (``time.process_time``).
The Redis and WAL figures are the whole server's: other clients' work in the
meantime is counted too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

#: Hosts of a database server on this machine (an empty host or a path: a Unix socket).
LOCAL_HOSTS = ("", "localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class RedisSample:
    """Cumulative counters of a Redis server: CPU seconds and ``EVALSHA`` calls and time."""

    cpu_s: float
    evalsha_calls: int
    evalsha_usec: int


@dataclass
class RedisUsage:
    """Redis server usage summed over the ``tally`` runs of one workload."""

    cpu_s: float = 0.0
    evalsha_calls: int = 0
    evalsha_usec: int = 0
    pushes: int = 0

    def add(self, before: RedisSample, after: RedisSample, commits: int) -> None:
        self.cpu_s += after.cpu_s - before.cpu_s
        self.evalsha_calls += after.evalsha_calls - before.evalsha_calls
        self.evalsha_usec += after.evalsha_usec - before.evalsha_usec
        self.pushes += commits

    def figures(self) -> dict[str, float]:
        """Redis CPU µs per counted insert (each one a commit that pushes), EVALSHA calls
        per commit, and the server's µs per EVALSHA call."""
        commits = max(self.pushes, 1)
        return {
            "redis_cpu_us_per_push": round(self.cpu_s * 1e6 / commits, 1),
            "evalsha_per_commit": round(self.evalsha_calls / commits, 3),
            "evalsha_usec_per_call": round(self.evalsha_usec / max(self.evalsha_calls, 1), 2),
        }


class RedisProbe:
    """Reads ``INFO cpu`` and ``INFO commandstats`` of the buffer's Redis (every node of a
    cluster, summed). The server's figures include any other client's work meanwhile."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def _nodes(self, section: str) -> list[dict]:
        info = self.client.info(section)
        if any(str(k).startswith(("used_cpu", "cmdstat_")) for k in info):
            return [info]  # one Redis
        return [v for v in info.values() if isinstance(v, dict)]  # a cluster: one per node

    def sample(self) -> RedisSample:
        cpu = sum(
            float(n.get("used_cpu_sys", 0)) + float(n.get("used_cpu_user", 0))
            for n in self._nodes("cpu")
        )
        calls = usec = 0
        for node in self._nodes("commandstats"):
            stats = node.get("cmdstat_evalsha") or {}
            calls += int(stats.get("calls", 0))
            usec += int(stats.get("usec", 0))
        return RedisSample(cpu, calls, usec)


def process_cpu_s(pid: int) -> float | None:
    """``utime + stime`` of process ``pid`` in seconds, from ``/proc``; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            raw = stat.read()
    except OSError:
        return None
    # The name, in parentheses, may hold spaces: split what follows it (field 3 onwards).
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


class BackendCpu:
    """CPU time of the PostgreSQL backends that serve the writers' connections.

    ``reason`` says why it cannot be read (then every sample is None): not
    PostgreSQL, a server on another host, or a backend this machine's ``/proc``
    does not show as a ``postgres`` process (a container, another machine).
    """

    def __init__(self, pids: list[int | None], host: str) -> None:
        self.pids = [pid for pid in pids if pid is not None]
        self.reason = self._unreadable(len(pids), host)

    def _unreadable(self, writers: int, host: str) -> str | None:
        if not self.pids or len(self.pids) != writers:
            return "the database is not PostgreSQL"
        if host not in LOCAL_HOSTS and not host.startswith("/"):
            return f"the server is at {host}, not on this machine"
        for pid in self.pids:
            if not _process_name(pid).startswith("postgres") or process_cpu_s(pid) is None:
                return f"backend {pid} is not a postgres process on this machine"
        return None

    def sample(self) -> float | None:
        if self.reason is not None:
            return None
        values = [process_cpu_s(pid) for pid in self.pids]
        return None if None in values else sum(v for v in values if v is not None)


def wal_position() -> int | None:
    """``pg_current_wal_lsn()`` as a byte position; None on other databases."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_lsn()::text")
        high, low = cursor.fetchone()[0].split("/")
    return (int(high, 16) << 32) + int(low, 16)


@dataclass(frozen=True)
class CostSample:
    backend_cpu_s: float | None
    wal: int | None
    redis: RedisSample | None = None


class CostProbe:
    """Samples the writers' backends' CPU time, the WAL position and the buffer's Redis
    (when given), around each run."""

    def __init__(self, backend: BackendCpu, redis: RedisProbe | None = None) -> None:
        self.backend = backend
        self.redis = redis

    def sample(self) -> CostSample:
        redis = self.redis.sample() if self.redis is not None else None
        return CostSample(self.backend.sample(), wal_position(), redis)


def _grown(total: float | None, before: float | None, after: float | None) -> float | None:
    """``total`` plus the growth from ``before`` to ``after``; None once any is unknown."""
    if total is None or before is None or after is None:
        return None
    return total + after - before


@dataclass
class Cost:
    """The cost of one (workload, mode), summed over its recorded runs."""

    ops: int = 0
    writer_cpu_s: float = 0.0
    backend_cpu_s: float | None = 0.0
    wal_bytes: float | None = 0.0
    redis_cpu_s: float | None = 0.0

    def add(self, ops: int, writer_cpu_s: float, before: CostSample, after: CostSample) -> None:
        self.ops += ops
        self.writer_cpu_s += writer_cpu_s
        self.backend_cpu_s = _grown(self.backend_cpu_s, before.backend_cpu_s, after.backend_cpu_s)
        self.wal_bytes = _grown(self.wal_bytes, before.wal, after.wal)
        self.redis_cpu_s = _grown(
            self.redis_cpu_s,
            before.redis.cpu_s if before.redis is not None else None,
            after.redis.cpu_s if after.redis is not None else None,
        )

    def figures(self, mode: str) -> dict[str, float | None]:
        """Writer CPU µs, backend CPU µs, WAL bytes and Redis CPU µs per insert (None: not
        measurable)."""
        ops = max(self.ops, 1)
        backend, wal, redis = self.backend_cpu_s, self.wal_bytes, self.redis_cpu_s
        return {
            f"{mode}_writer_cpu_us": round(self.writer_cpu_s * 1e6 / ops, 1),
            f"{mode}_backend_cpu_us": None if backend is None else round(backend * 1e6 / ops, 1),
            f"{mode}_wal_bytes": None if wal is None else round(wal / ops, 1),
            f"{mode}_redis_cpu_us": None if redis is None else round(redis * 1e6 / ops, 1),
        }
