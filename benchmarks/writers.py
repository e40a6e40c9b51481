"""Writer processes: notification inserts under four counter strategies, timed in parallel.

Modes:

- ``off``: the insert alone, inside ``counters.paused()`` so nothing is counted;
- ``naive``: the same insert plus ``UPDATE ... SET count = count + 1`` of the
  recipient's counter row in the same transaction;
- ``tally``: ``Notification.objects.create()``, the real counted path (the
  delta goes to Redis after COMMIT), with ``COUNTERS_DURABLE`` off;
- ``durable``: the same with ``COUNTERS_DURABLE`` on: one outbox row INSERTed
  before the COMMIT, DELETEd after the push.

Each writer is a spawned process with its own database connection and Redis
client, set up once and then driven over a pipe: every run starts at the same
wall-clock instant in all writers and lasts the same number of seconds.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from .child import ChildContext
from .errors import BenchError

MODES = ("off", "naive", "tally", "durable")
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

    return {"off": off, "naive": naive, "tally": tally, "durable": tally}


def perform(run: Run, op: Callable[[int], None], pick: Callable[[], int]) -> Done:
    time.sleep(max(0.0, run.start_at - time.time()))
    ops = 0
    started = time.perf_counter()
    end = started + run.seconds
    while True:
        op(pick())
        ops += 1
        now = time.perf_counter()
        if now >= end:
            return Done(ops, now - started)


def writer_main(
    conn: Connection, context: ChildContext, users: list[int], hot: int, seed: int
) -> None:
    """Body of one writer process: answer every :class:`Run` with a :class:`Done`."""
    context.setup()
    from django.conf import settings
    from django.db import connection

    ops = operations()
    rng = random.Random(seed)
    pickers = {"hot": lambda: hot, "spread": lambda: users[rng.randrange(len(users))]}
    connection.ensure_connection()
    conn.send(("ready", None))
    while (run := conn.recv()) is not None:
        try:
            # Set for the whole run: ``tally`` and ``durable`` share one operation.
            settings.COUNTERS_DURABLE = DURABLE.get(run.mode, False)
            conn.send(("done", perform(run, ops[run.mode], pickers[run.workload])))
        except Exception as exc:
            conn.send(("error", f"{run.mode}/{run.workload}: {type(exc).__name__}: {exc}"))
    connection.close()


class WriterPool:
    """``processes`` writer processes, started once and driven run by run."""

    def __init__(
        self, processes: int, context: ChildContext, users: list[int], hot: int, timeout: float
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.timeout = timeout
        self.conns: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.ops: dict[str, int] = dict.fromkeys(MODES, 0)
        try:
            for i in range(processes):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=writer_main,
                    args=(child, context, users, hot, i + 1),
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

    def run(self, mode: str, workload: str, seconds: float) -> float:
        """Run every writer for ``seconds``; total operations per second."""
        run = Run(mode, workload, time.time() + START_DELAY, seconds)
        for conn in self.conns:
            conn.send(run)
        done: list[Done] = self._collect(START_DELAY + seconds + self.timeout)
        self.ops[mode] += sum(d.ops for d in done)
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


def measure(pool: WriterPool, rounds: int, seconds: float, warmup: float) -> dict:
    """Interleaved rounds of every (workload, mode); median ops/s and ratios per workload.

    A ratio is the median of the per-round ratios: the runs of one round are
    adjacent in time, so they share whatever else the machine was doing.
    """
    for workload in WORKLOADS:
        for mode in MODES:
            if warmup > 0:
                pool.run(mode, workload, warmup)
    rates: dict[str, dict[str, list[float]]] = {w: {m: [] for m in MODES} for w in WORKLOADS}
    for r in range(rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for workload in WORKLOADS:
            for mode in order:
                rates[workload][mode].append(pool.run(mode, workload, seconds))
    result: dict = {}
    for workload, by_mode in rates.items():
        medians = {mode: statistics.median(values) for mode, values in by_mode.items()}
        tally, durable = by_mode["tally"], by_mode["durable"]
        result[workload] = {
            **{f"{mode}_ops_per_s": round(v, 1) for mode, v in medians.items()},
            "tally_off": round(_ratio(tally, by_mode["off"]), 3),
            "tally_naive": round(_ratio(tally, by_mode["naive"]), 3),
            "durable_off": round(_ratio(durable, by_mode["off"]), 3),
            "durable_tally": round(_ratio(durable, tally), 3),
            "rounds": {mode: [round(v, 1) for v in values] for mode, values in by_mode.items()},
        }
    return result


def _ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))
