"""Writer processes: notification inserts under five counter strategies, timed in parallel.

Modes:

- ``off``: the insert alone, inside ``counters.paused()`` so nothing is counted;
- ``naive``: the same insert plus ``UPDATE ... SET count = count + 1`` of the
  recipient's counter row in the same transaction;
- ``tally``: ``Notification.objects.create()``, the real counted path (the
  delta goes to Redis after COMMIT), with ``COUNTERS_DURABLE`` off;
- ``durable``: the same with ``COUNTERS_DURABLE`` on: one outbox row INSERTed
  before the COMMIT, DELETEd after the push;
- ``sender``: ``tally`` with the per-process sender on
  (``COUNTERS_SEND_DELAY_MS`` = ``--send-delay``, 5 ms by default): a COMMIT queues its
  delta, a thread pushes the queue in one round trip.

Each writer is a spawned process with its own database connection and Redis
client, set up once and then driven over a pipe: every run starts at the same
wall-clock instant in all writers and lasts the same number of seconds.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .child import ChildContext
from .config import SENDER_DELAY_MS
from .errors import BenchError

MODES = ("off", "naive", "tally", "durable", "sender")
#: The value of COUNTERS_DURABLE each mode runs with (the others do not count through Tally).
DURABLE = {"tally": False, "durable": True}
WORKLOADS = ("spread", "hot")

#: Seconds between sending a run to the writers and its start in all of them.
START_DELAY = 0.05


class WriterError(BenchError):
    """A writer process failed or vanished."""


@dataclass(frozen=True)
class Run:
    mode: str
    workload: str
    start_at: float
    seconds: float


@dataclass(frozen=True)
class Done:
    ops: int
    seconds: float
    #: Seconds each operation took, in the order they ran.
    latencies: list[float]


def operations() -> dict[str, Callable[[int], None]]:
    """One insert per mode for recipient id ``uid``. Django must be set up."""
    from django.db import transaction
    from django.db.models import F

    from counters import paused
    from notifications.models import Notification, UnreadCounter

    def off(uid: int) -> None:
        with paused():
            Notification(recipient_id=uid, verb="bench").save(force_insert=True)

    def naive(uid: int) -> None:
        with transaction.atomic():
            off(uid)
            UnreadCounter.objects.filter(pk=uid).update(count=F("count") + 1)

    def tally(uid: int) -> None:
        Notification.objects.create(recipient_id=uid, verb="bench")

    return {"off": off, "naive": naive, "tally": tally, "durable": tally, "sender": tally}


def perform(run: Run, op: Callable[[int], None], pick: Callable[[], int]) -> Done:
    time.sleep(max(0.0, run.start_at - time.time()))
    latencies: list[float] = []
    clock = time.perf_counter
    started = now = clock()
    end = started + run.seconds
    while True:
        key = pick()
        before = now
        op(key)
        now = clock()
        latencies.append(now - before)
        if now >= end:
            return Done(len(latencies), now - started, latencies)


def writer_main(
    conn: Connection,
    context: ChildContext,
    users: list[int],
    hot: int,
    seed: int,
    send_delay_ms: float = SENDER_DELAY_MS,
) -> None:
    """Body of one writer process: answer every :class:`Run` with a :class:`Done`."""
    context.setup()
    from django.conf import settings
    from django.db import connection

    from counters import sender

    ops = operations()
    rng = random.Random(seed)
    pickers = {"hot": lambda: hot, "spread": lambda: users[rng.randrange(len(users))]}
    connection.ensure_connection()
    conn.send(("ready", None))
    while (run := conn.recv()) is not None:
        try:
            # Set for the whole run: ``tally`` and ``durable`` share one operation.
            settings.COUNTERS_DURABLE = DURABLE.get(run.mode, False)
            settings.COUNTERS_SEND_DELAY_MS = send_delay_ms if run.mode == "sender" else 0
            done = perform(run, ops[run.mode], pickers[run.workload])
            sender.push_queued()  # the queue's tail, before the next run
            conn.send(("done", done))
        except Exception as exc:
            conn.send(("error", f"{run.mode}/{run.workload}: {type(exc).__name__}: {exc}"))
    connection.close()


class WriterPool:
    """``processes`` writer processes, started once and driven run by run."""

    def __init__(
        self,
        processes: int,
        context: ChildContext,
        users: list[int],
        hot: int,
        timeout: float,
        send_delay_ms: float = SENDER_DELAY_MS,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.timeout = timeout
        self.conns: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.ops: dict[str, int] = dict.fromkeys(MODES, 0)
        #: Seconds per operation of every recorded run, by (workload, mode).
        self.latencies: dict[tuple[str, str], list[float]] = {}
        try:
            for i in range(processes):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=writer_main,
                    args=(child, context, users, hot, i + 1, send_delay_ms),
                    name=f"bench-writer-{i}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            self._collect(timeout + 60)
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout: float) -> list:
        replies = []
        deadline = time.monotonic() + timeout
        for i, conn in enumerate(self.conns):
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise WriterError(f"writer {i} did not answer within {timeout:.0f}s")
                kind, value = conn.recv()
            except (EOFError, OSError) as exc:
                raise WriterError(f"writer {i} exited (status {self.procs[i].exitcode})") from exc
            if kind == "error":
                raise WriterError(value)
            replies.append(value)
        return replies

    def run(self, mode: str, workload: str, seconds: float, record: bool = True) -> float:
        """Run every writer for ``seconds``; total operations per second.

        ``record`` keeps the latency of each operation (not for warm-up runs).
        """
        run = Run(mode, workload, time.time() + START_DELAY, seconds)
        for conn in self.conns:
            conn.send(run)
        done: list[Done] = self._collect(START_DELAY + seconds + self.timeout)
        self.ops[mode] += sum(d.ops for d in done)
        if record:
            kept = self.latencies.setdefault((workload, mode), [])
            for d in done:
                kept.extend(d.latencies)
        return sum(d.ops / d.seconds for d in done)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def percentile(values: list[float], share: float) -> float:
    """The ``share`` (0..1) percentile of ``values``, nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


#: Modes whose runs the Redis probe samples.
SAMPLED = ("tally", "sender")


def measure(
    pool: WriterPool,
    rounds: int,
    seconds: float,
    warmup: float,
    redis: RedisProbe | None = None,
) -> dict:
    """Interleaved rounds of every (workload, mode); median ops/s and ratios per workload.

    A ratio is the median of the per-round ratios: the runs of one round are
    adjacent in time, so they share whatever else the machine was doing. The
    p50 and p99 latency of one operation are over every operation of every
    writer in every round. With ``redis``, the Redis server's CPU time and
    ``EVALSHA`` calls are sampled around each ``tally`` and ``sender`` run.
    """
    for workload in WORKLOADS:
        for mode in MODES:
            if warmup > 0:
                pool.run(mode, workload, warmup, record=False)
    rates: dict[str, dict[str, list[float]]] = {w: {m: [] for m in MODES} for w in WORKLOADS}
    server = {(w, m): RedisUsage() for w in WORKLOADS for m in SAMPLED}
    for r in range(rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for workload in WORKLOADS:
            for mode in order:
                before = pool.ops[mode]
                sampled = redis.sample() if redis is not None and mode in SAMPLED else None
                rates[workload][mode].append(pool.run(mode, workload, seconds))
                if sampled is not None and redis is not None:
                    usage = server[(workload, mode)]
                    usage.add(sampled, redis.sample(), pool.ops[mode] - before)
    result: dict = {}
    for workload, by_mode in rates.items():
        medians = {mode: statistics.median(values) for mode, values in by_mode.items()}
        tally, durable = by_mode["tally"], by_mode["durable"]
        latency: dict[str, float] = {}
        for mode in MODES:
            kept = pool.latencies.get((workload, mode), [])
            latency[f"{mode}_p50_ms"] = round(percentile(kept, 0.50) * 1000, 3)
            latency[f"{mode}_p99_ms"] = round(percentile(kept, 0.99) * 1000, 3)
        result[workload] = {
            **{f"{mode}_ops_per_s": round(v, 1) for mode, v in medians.items()},
            "tally_off": round(_ratio(tally, by_mode["off"]), 3),
            "tally_naive": round(_ratio(tally, by_mode["naive"]), 3),
            "durable_off": round(_ratio(durable, by_mode["off"]), 3),
            "durable_tally": round(_ratio(durable, tally), 3),
            "sender_off": round(_ratio(by_mode["sender"], by_mode["off"]), 3),
            "sender_tally": round(_ratio(by_mode["sender"], tally), 3),
            **latency,
            **(server[(workload, "tally")].figures() if redis is not None else {}),
            **(
                {f"sender_{k}": v for k, v in server[(workload, "sender")].figures().items()}
                if redis is not None
                else {}
            ),
            "rounds": {mode: [round(v, 1) for v in values] for mode, values in by_mode.items()},
        }
    return result


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


def _ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))
