"""Real ``celery`` worker and beat subprocesses for the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


class CeleryProcs:
    """Celery subprocesses, each in its own process group, logging to ``<logdir>/<name>.log``."""

    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        self.env = env
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(
        self,
        name: str,
        command: str,
        *args: str,
        app: str = "config",
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Start ``celery -A <app> <command> <args>`` as ``name`` (worker, beat)."""
        log = (self.logdir / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, command, "--loglevel=INFO", *args],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self.procs[name]

    def worker(self, name: str, *args: str, **kwargs) -> subprocess.Popen:
        """A worker that runs one task at a time and reserves at most one more."""
        return self.start(
            name,
            "worker",
            "--pool=solo",
            "--prefetch-multiplier=1",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            f"--hostname={name}-{os.getpid()}@%h",
            *args,
            **kwargs,
        )

    def beat(self) -> subprocess.Popen:
        return self.start(
            "beat",
            "beat",
            "--scheduler=django_celery_beat.schedulers:DatabaseScheduler",
            "--max-interval=1",
        )

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` and its process group, and reap it."""
        proc = self.procs[name]
        signal_group(proc, signal.SIGKILL)
        proc.wait(10)

    def check_alive(self, *names: str) -> None:
        for name in names or tuple(self.procs):
            proc = self.procs[name]
            if proc.poll() is not None:
                pytest.fail(f"celery {name} exited with {proc.returncode} (output below)")

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def output(self) -> str:
        return "\n".join(
            f"----- celery {name} -----\n{self.log(name)[-20_000:]}" for name in self.procs
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            # Also reaps children the process may have left in its group.
            signal_group(proc, signal.SIGKILL)
            proc.wait(10)
