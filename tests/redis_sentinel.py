"""A throwaway Redis Sentinel setup: a master, one replica and three sentinels on free ports.

Built as an operator builds one: the replica started with ``--replicaof``, and
each sentinel from a config file of its own (``sentinel monitor <service>
<master> 2``, quorum 2 of 3). Sentinels are ``redis-sentinel`` when Debian's
package is installed, else ``redis-server --sentinel`` (the same program);
under ``TALLY_REDIS_SERVER=valkey`` (or ``kind="valkey"``) every process is
``valkey-server``. A test may SIGKILL the master and wait for the sentinels
to promote the replica (:meth:`SentinelSet.fail_master`).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from tests.redis_server import SERVER, binary, free_port

SERVICE = "mymaster"
SENTINELS = 3


def _answers(port: int, proc: subprocess.Popen, timeout: float = 10) -> None:
    """Until the process on ``port`` answers a PING; raise if it died or never did."""
    client = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=1)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server on port {port} exited with {proc.returncode}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
    finally:
        client.close()


class SentinelSet:
    """A master and its replica, monitored by three sentinels as ``service``."""

    def __init__(
        self,
        kind: str | None = None,
        service: str = SERVICE,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 10_000,
    ) -> None:
        self.kind = kind or SERVER
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.dir = Path(tempfile.mkdtemp(prefix="tally-sentinel-"))
        self.servers: dict[int, subprocess.Popen] = {}  # port -> master or replica
        self.sentinel_procs: dict[int, subprocess.Popen] = {}

    @property
    def sentinels(self) -> list[str]:
        """``COUNTERS_REDIS_SENTINELS``: every sentinel as host:port."""
        return [f"127.0.0.1:{port}" for port in self.sentinel_procs]

    @property
    def url(self) -> str:
        """``COUNTERS_REDIS_URL`` beside the sentinels: scheme and database of the master."""
        return (
            "valkey://sentinel-master/0" if self.kind == "valkey" else "redis://sentinel-master/0"
        )

    def _server(self, port: int, *args: str) -> subprocess.Popen:
        folder = self.dir / str(port)
        folder.mkdir()
        proc = subprocess.Popen(
            [
                binary("server", self.kind),
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(folder),
                "--save", "",
                "--appendonly", "no",
                "--repl-diskless-sync-delay", "0",
                "--logfile", str(folder / "server.log"),
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.servers[port] = proc
        _answers(port, proc)
        return proc

    def _sentinel_argv(self, conf: Path) -> list[str]:
        program = shutil.which("redis-sentinel") if self.kind == "redis" else None
        if program:
            return [program, str(conf)]
        return [binary("server", self.kind), str(conf), "--sentinel"]

    def _sentinel(self, port: int, master: int) -> None:
        folder = self.dir / f"sentinel-{port}"
        folder.mkdir()
        conf = folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\n"
            "bind 127.0.0.1\n"
            f"dir {folder}\n"
            f"logfile {folder / 'sentinel.log'}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {master} 2\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {self.service} 1\n"
        )
        proc = subprocess.Popen(
            self._sentinel_argv(conf), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.sentinel_procs[port] = proc
        _answers(port, proc)

    def start(self, timeout: float = 60) -> SentinelSet:
        master, replica = free_port(), free_port()
        self._server(master)
        self._server(replica, "--replicaof", "127.0.0.1", str(master))
        self.wait_replica_in_sync(replica, timeout)
        for _ in range(SENTINELS):
            self._sentinel(free_port(), master)
        self.wait_watched(timeout)
        return self

    def _sentinel_client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, decode_responses=True)

    def _state(self, port: int) -> dict:
        client = self._sentinel_client(port)
        try:
            return client.sentinel_master(self.service)
        finally:
            client.close()

    def wait_watched(self, timeout: float = 60) -> None:
        """Until every live sentinel knows the replica and the other sentinels (a failover
        needs both)."""
        deadline = time.monotonic() + timeout
        while True:
            states = []
            live = [p for p, proc in self.sentinel_procs.items() if proc.poll() is None]
            with contextlib.suppress(redis.RedisError):
                states = [self._state(port) for port in live]
            ready = [
                s
                for s in states
                if int(s["num-slaves"]) >= 1 and int(s["num-other-sentinels"]) == SENTINELS - 1
            ]
            if states and len(ready) == len(states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sentinels did not see the whole setup: {states}")
            time.sleep(0.1)

    def wait_replica_in_sync(self, replica: int, timeout: float = 60) -> None:
        client = redis.Redis(port=replica, decode_responses=True)
        deadline = time.monotonic() + timeout
        try:
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the replica on {replica} did not sync")
                time.sleep(0.05)
        finally:
            client.close()

    def master_port(self) -> int:
        """Port of the master, as the first sentinel that answers names it."""
        for port in self.sentinel_procs:
            client = self._sentinel_client(port)
            try:
                return int(client.sentinel_get_master_addr_by_name(self.service)[1])
            except (redis.RedisError, TypeError):
                continue
            finally:
                client.close()
        raise RuntimeError("no sentinel answered")

    def replica_port(self) -> int:
        """Port of the server that is not the master now."""
        master = self.master_port()
        [replica] = [p for p, proc in self.servers.items() if p != master and proc.poll() is None]
        return replica

    def role(self, port: int) -> str:
        client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
        try:
            return client.info("replication")["role"]
        finally:
            client.close()

    def fail_master(self, timeout: float = 60) -> tuple[int, int, float]:
        """SIGKILL the master; wait until every live sentinel names the replica and it is a
        master. Returns (killed port, promoted port, seconds from the kill to that)."""
        killed, promoted = self.master_port(), self.replica_port()
        self.kill(killed)
        started = time.monotonic()
        self.wait_promoted(promoted, timeout)
        return killed, promoted, time.monotonic() - started

    def wait_promoted(self, port: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            named = set()
            for sentinel, proc in self.sentinel_procs.items():
                if proc.poll() is None:
                    client = self._sentinel_client(sentinel)
                    try:
                        named.add(int(client.sentinel_get_master_addr_by_name(self.service)[1]))
                    except (redis.RedisError, TypeError):
                        named.add(-1)
                    finally:
                        client.close()
            with contextlib.suppress(redis.RedisError):
                if named == {port} and self.role(port) == "master":
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sentinels did not promote {port}: they name {named}")
            time.sleep(0.05)

    def pause(self, port: int) -> None:
        """SIGSTOP a server: it neither answers nor replicates until :meth:`resume`."""
        self.servers[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.servers[port].send_signal(signal.SIGCONT)

    def kill(self, port: int) -> None:
        """SIGKILL a server (the master or the replica)."""
        proc = self.servers[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in [*self.sentinel_procs.values(), *self.servers.values()]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SentinelSet:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
