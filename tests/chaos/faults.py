"""The chaos thread: SIGKILLs flushers, drops their DB connections, restarts Redis empty.

Kills and terminations aim at a phase of a flush. The thread watches
``pg_stat_activity`` for a flusher connection (told apart by its
``application_name``) that is

* ``in_flush``: running any statement or transaction (epoch check, ledger
  lookup, apply), struck a few milliseconds later;
* ``in_tx``: inside the apply transaction (it has written: ``backend_xid``);
* ``at_commit``: running COMMIT (slowed down by a deferred trigger, see
  ``audit.py``). A client killed there leaves a batch that the database
  committed but Redis still holds in flight; a terminated backend rolls it back.

If the phase does not show up within a short window, a kill strikes anyway
(``elsewhere``: a flusher can also die while it starts or talks to Redis).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import psycopg
from redis import RedisError

from counters.buffer.store import Buffer
from tests.chaos.harness import CeleryFlusher, CommandFlusher
from tests.redis_server import RedisServer

FLUSHERS = (CommandFlusher.APP, CeleryFlusher.APP)

PHASES = {
    "in_flush": "xact_start IS NOT NULL",
    "in_tx": "backend_xid IS NOT NULL AND NOT (state = 'active' AND query = 'COMMIT')",
    "at_commit": "state = 'active' AND query = 'COMMIT'",
}
KILL_PHASES = {"in_flush": 3, "in_tx": 4, "at_commit": 4}
TERMINATE_PHASES = {"in_tx": 1, "at_commit": 1}

BACKENDS_SQL = """
SELECT pid, application_name FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND application_name = ANY(%s) AND {phase}
"""


class Chaos(threading.Thread):
    """Runs one trial's plan of faults until it is done or stopped."""

    WATCH = 3.0  # seconds to wait for a flusher to be inside a transaction

    def __init__(
        self,
        *,
        dsn: str,
        command: CommandFlusher,
        celery: CeleryFlusher,
        redis: RedisServer,
        seconds: float,
        restart_redis: bool,
        rnd: random.Random,
        buffer: Buffer,
    ) -> None:
        super().__init__(name="chaos", daemon=True)
        self.dsn = dsn
        self.buffer = buffer
        self.seen_stranded: set[str] = set()
        self.command = command
        self.celery = celery
        self.redis = redis
        self.seconds = seconds
        self.restart_redis_planned = restart_redis
        self.rnd = rnd
        self.stopping = threading.Event()
        self.stats: Counter[str] = Counter()
        self.errors: list[BaseException] = []
        self.plan = self.make_plan()

    def make_plan(self) -> list[tuple[float, str]]:
        """Fault times: kills and terminations all along, a Redis restart in the middle."""
        plan: list[tuple[float, str]] = []
        for kind, low, high in (
            ("kill_command", 1.5, 3.5),
            ("kill_celery", 4.0, 7.0),
            ("terminate", 1.5, 3.5),
        ):
            at = self.rnd.uniform(0.5, high)
            while at < self.seconds - 1:
                plan.append((at, kind))
                at += self.rnd.uniform(low, high)
        if self.restart_redis_planned:
            plan.append((self.seconds * self.rnd.uniform(0.3, 0.6), "restart_redis"))
        return sorted(plan)

    def run(self) -> None:
        started = time.monotonic()
        try:
            with psycopg.connect(self.dsn, autocommit=True, application_name="tally-chaos") as db:
                self.db = db
                for at, kind in self.plan:
                    if self.stopping.wait(max(0.0, started + at - time.monotonic())):
                        return
                    getattr(self, kind)()
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    # -- targets ----------------------------------------------------------------
    def phase(self, weights: dict[str, int]) -> str:
        return self.rnd.choices(list(weights), list(weights.values()))[0]

    def watch(self, apps: tuple[str, ...], phase: str) -> tuple[int, str] | None:
        """A flusher backend in ``phase``, watched for up to WATCH seconds."""
        sql = BACKENDS_SQL.format(phase=PHASES[phase])
        deadline = time.monotonic() + self.WATCH
        while not self.stopping.is_set() and time.monotonic() < deadline:
            rows = self.db.execute(sql, [list(apps)]).fetchall()
            if rows:
                if phase == "in_flush":
                    time.sleep(self.rnd.uniform(0, 0.015))
                return self.rnd.choice(rows)
            time.sleep(0.002)
        return None

    # -- faults -----------------------------------------------------------------
    def kill_command(self) -> None:
        phase = self.phase(KILL_PHASES)
        target = self.watch((CommandFlusher.APP,), phase)
        if self.command.kill():
            self.stats["kill_command"] += 1
            self.stats[f"kill_{phase if target else 'elsewhere'}"] += 1
            self.stranded()

    def kill_celery(self) -> None:
        if not self.celery.worker_alive():
            self.stats["worker_found_dead"] += 1
        else:
            phase = self.phase(KILL_PHASES)
            target = self.watch((CeleryFlusher.APP,), phase)
            if self.celery.kill_worker():
                self.stats["kill_celery"] += 1
                self.stats[f"kill_{phase if target else 'elsewhere'}"] += 1
                self.stranded()
        if not self.stopping.wait(self.rnd.uniform(0.2, 1.0)):
            self.celery.start_worker()

    def stranded(self) -> None:
        """Count the batches a kill left in flight: committed (in the ledger) or not.

        A moment after the kill the killed client's COMMIT, if it had reached
        the server, has finished, while its shard stays leased for up to
        ``COUNTERS_LEASE_TIMEOUT``: what is then in flight was left there.
        """
        time.sleep(0.3)
        try:
            ids = set(self.buffer.inflight_ids().values()) - self.seen_stranded
        except RedisError:
            return
        if not ids:
            return
        self.seen_stranded |= ids
        rows = self.db.execute(
            "SELECT count(*) FROM counters_flushbatch WHERE batch_id = ANY(%s)", [list(ids)]
        ).fetchone()
        self.stats["stranded_committed"] += rows[0]
        self.stats["stranded_uncommitted"] += len(ids) - rows[0]

    def terminate(self) -> None:
        phase = self.phase(TERMINATE_PHASES)
        target = self.watch(FLUSHERS, phase)
        if target is None:
            self.stats["terminate_missed"] += 1
            return
        pid, _ = target
        if self.db.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0]:
            self.stats["pg_terminate"] += 1
            self.stats[f"pg_terminate_{phase}"] += 1

    def restart_redis(self) -> None:
        """SIGKILL the buffer's Redis and start it empty on the same port (never left down)."""
        self.redis.kill()
        time.sleep(self.rnd.uniform(0.2, 1.0))
        self.redis.start()
        self.stats["redis_restart"] += 1
