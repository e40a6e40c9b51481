"""Real processes of the chaos suite: writers, the cron-style flusher, Celery worker and beat.

Every process runs in its own process group (``start_new_session``), so a
SIGKILL reaches its children too, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Config:
    """How long and how hard one chaos run pushes."""

    minutes: float  # 0: quick mode, a fixed number of trials
    trials: int  # quick mode: trials to run; soak: at least this many
    trial_seconds: float
    restart_every: int  # every n-th trial restarts Redis (from the 2nd on)
    writers: int = 3
    # quick mode: trials to add, one at a time, while a kind of fault has not happened yet
    extra_trials: int = 3
    users: int = 80
    shards: int = 4
    batch_size: int = 10
    lease_timeout: float = 2.0
    socket_timeout: float = 0.5
    writer_pause: float = 0.003
    seed: int = int(os.environ.get("TALLY_CHAOS_SEED", "0")) or int(time.time())

    @classmethod
    def quick(cls) -> Config:
        return cls(minutes=0, trials=3, trial_seconds=16, restart_every=2)

    @classmethod
    def soak(cls, minutes: float) -> Config:
        return cls(minutes=minutes, trials=3, trial_seconds=40, restart_every=3)

    @classmethod
    def related(cls, minutes: float = 0) -> Config:
        """The related-key run: one trial of 24 s (quick) or trials of 40 s (soak), no Redis
        restart."""
        if minutes:
            return cls(minutes=minutes, trials=1, trial_seconds=40, restart_every=0)
        return cls(minutes=0, trials=1, trial_seconds=24, restart_every=0, extra_trials=2)

    def restarts_redis(self, trial: int) -> bool:
        """Trial numbers start at 1; the first trial never restarts Redis, nor does any
        when ``restart_every`` is 0."""
        return self.restart_every > 0 and trial > 1 and trial % self.restart_every == 0

    def more_trials(self, done: int, elapsed: float, missing: Sequence[str] = ()) -> bool:
        """Whether to run another trial after ``done`` of them.

        ``missing`` names the kinds of fault that have not happened yet: the
        faults are drawn at random, so a quick run adds up to ``extra_trials``
        trials until each has happened at least once.
        """
        if done < self.trials:
            return True
        if self.minutes:
            return elapsed < self.minutes * 60
        return bool(missing) and done < self.trials + self.extra_trials


def spawn(argv: list[str], cwd: Path, env: dict[str, str], log) -> subprocess.Popen:
    """A process in a session of its own (killable as a group), stdout piped, stderr to ``log``."""
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )


def signal_group(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to ``proc``'s process group; True if the process was still running."""
    if proc is None:
        return False
    alive = proc.poll() is None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    return alive


def stop_group(proc: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL the whole group and reap."""
    if proc is None:
        return
    if grace > 0 and proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


class CommandFlusher:
    """Keeps ``manage.py notification_update_counter`` running, as cron would, back to back.

    Whenever it exits or is killed it is started again after a short pause.
    Completed runs print their FlushResult as JSON; those are summed.
    """

    APP = "tally-flusher-cmd"
    PAUSE = 0.2

    def __init__(self, manage: list[str], cwd: Path, env: dict[str, str], logdir: Path) -> None:
        self.argv = [*manage, "notification_update_counter", "--json", "--time-budget", "5"]
        self.cwd = cwd
        self.env = env
        self.log_path = logdir / "flusher-command.log"
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.exits: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()

    def start(self) -> None:
        self.stopping.clear()
        self.thread = threading.Thread(target=self._loop, name="command-flusher", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        with self.log_path.open("a") as log:
            while not self.stopping.is_set():
                with self.lock:
                    if self.stopping.is_set():
                        break
                    self.proc = spawn(self.argv, self.cwd, self.env, log)
                proc = self.proc
                try:
                    out, _ = proc.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    signal_group(proc)
                    out, _ = proc.communicate(timeout=10)
                self._record(proc.returncode, out)
                self.stopping.wait(self.PAUSE)

    def _record(self, code: int, out: str) -> None:
        self.exits["ok" if code == 0 else "killed" if code == -signal.SIGKILL else "failed"] += 1
        if code == 0 and out.strip():
            result = json.loads(out.strip().splitlines()[-1])
            for name in ("batches", "keys", "recovered", "already_applied"):
                self.totals[name] += result[name]
            self.totals["lost_shards"] += len(result["lost_shards"])

    def kill(self) -> bool:
        """SIGKILL the running command (the loop starts the next one)."""
        with self.lock:
            return signal_group(self.proc)

    def stop(self, grace: float = 10.0) -> None:
        """Stop restarting; let the current run finish for up to ``grace`` seconds."""
        self.stopping.set()
        with self.lock:
            proc = self.proc
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
            signal_group(proc)
        if self.thread is not None:
            self.thread.join(15)
            self.thread = None


SUMMARY = re.compile(r"flushed (\d+) batches.*")


class CeleryFlusher:
    """A Celery worker that the chaos kills and restarts, and one beat that runs throughout."""

    APP = "tally-flusher-celery"

    def __init__(
        self, cwd: Path, env: dict[str, str], beat_env: dict[str, str], logdir: Path
    ) -> None:
        self.cwd = cwd
        self.env = env
        self.beat_env = beat_env
        self.logdir = logdir
        self.worker: subprocess.Popen | None = None
        self.beat: subprocess.Popen | None = None
        self.starts = 0
        self.lock = threading.Lock()

    def _celery(self, name: str, env: dict[str, str], *args: str) -> subprocess.Popen:
        with (self.logdir / f"celery-{name}.log").open("a") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "config", name, "--loglevel=INFO", *args],
                cwd=self.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_beat(self) -> None:
        self.beat = self._celery(
            "beat",
            self.beat_env,
            "--scheduler=django_celery_beat.schedulers:DatabaseScheduler",
            "--max-interval=1",
        )

    def start_worker(self) -> None:
        with self.lock:
            if self.worker is not None and self.worker.poll() is None:
                return
            self.starts += 1
            self.worker = self._celery(
                "worker",
                self.env,
                "--pool=solo",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                f"--hostname=chaos-{os.getpid()}-{self.starts}@%h",
            )

    def kill_worker(self) -> bool:
        with self.lock:
            alive = signal_group(self.worker)
            if self.worker is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.worker.wait(10)
            return alive

    def worker_alive(self) -> bool:
        return self.worker is not None and self.worker.poll() is None

    def stop_worker(self, grace: float = 10.0) -> None:
        with self.lock:
            stop_group(self.worker, grace)

    def stop_all(self) -> None:
        stop_group(self.worker, 0)
        stop_group(self.beat, 0)

    def beat_alive(self) -> bool:
        return self.beat is not None and self.beat.poll() is None

    def flush_totals(self) -> Counter[str]:
        """Batches, recoveries and ledger hits reported in the worker's log."""
        totals: Counter[str] = Counter()
        path = self.logdir / "celery-worker.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        for line in text.splitlines():
            match = SUMMARY.search(line)
            if match:
                totals["batches"] += int(match.group(1))
                for name, pattern in (
                    ("recovered", r"(\d+) recovered"),
                    ("already_applied", r"(\d+) already applied"),
                ):
                    if found := re.search(pattern, line):
                        totals[name] += int(found.group(1))
            totals["lost_shards_logged"] += "Redis lost the buffer" in line
        return totals

    def log_tail(self, chars: int = 6000) -> str:
        parts = []
        for name in ("worker", "beat"):
            path = self.logdir / f"celery-{name}.log"
            if path.exists():
                parts.append(f"--- celery {name} ---\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)


class Writers:
    """Writer processes (``python -m <module>``, by default ``tests.chaos.writer``) of one trial."""

    def __init__(
        self, cwd: Path, env: dict[str, str], logdir: Path, module: str = "tests.chaos.writer"
    ) -> None:
        self.cwd = cwd
        self.env = env
        self.logdir = logdir
        self.module = module
        self.procs: list[subprocess.Popen] = []

    def start(
        self, count: int, seconds: float, seed: int, pause: float, args: Sequence[str]
    ) -> None:
        """Start ``count`` writers, each with its own seed, ``args`` naming what they write to."""
        for i in range(count):
            with (self.logdir / f"writer-{i}.log").open("a") as log:
                argv = [
                    sys.executable,
                    "-m",
                    self.module,
                    f"--seconds={seconds}",
                    f"--seed={seed * 100 + i}",
                    *args,
                    f"--pause={pause}",
                    f"--name=writer-{i}",
                ]
                self.procs.append(spawn(argv, self.cwd, self.env, log))

    def wait(self, timeout: float) -> list[dict]:
        """Reports of every writer; a writer that overruns ``timeout`` is killed and fails."""
        deadline = time.monotonic() + timeout
        reports = []
        try:
            for proc in self.procs:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if proc.returncode != 0:
                    raise AssertionError(f"writer exited with {proc.returncode}: {self.log_tail()}")
                reports.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            self.kill()
        return reports

    def kill(self) -> None:
        for proc in self.procs:
            stop_group(proc, 0)
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = []

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(
            p.read_text(errors="replace")[-chars:] for p in sorted(self.logdir.glob("writer-*.log"))
        )
