"""A throwaway Redis Cluster: six redis-server processes (3 masters, 3 replicas) on free ports.

Built the way an operator builds one: ``redis-server --cluster-enabled yes``
per node, then ``redis-cli --cluster create … --cluster-replicas 1``. A test
may SIGKILL a master and wait for its replica to be promoted. Under
``TALLY_REDIS_SERVER=valkey`` (or ``kind="valkey"``) the nodes are
``valkey-server`` processes, and ``valkey-cli`` creates the cluster.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from tests.redis_server import SERVER, binary

NODES = 6


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(1000):
        port = random.randrange(20_000, 50_000)
        if _free(port) and _free(port + 10_000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _port(fields: list[str]) -> int:
    """The port of a CLUSTER NODES line ("<id> <ip>:<port>@<bus port> ...")."""
    return int(fields[1].split("@")[0].rsplit(":", 1)[1])


class RedisCluster:
    def __init__(
        self, nodes: int = NODES, node_timeout_ms: int = 1000, kind: str | None = None
    ) -> None:
        self.kind = kind or SERVER
        self.ports: list[int] = []
        while len(self.ports) < nodes:
            port = cluster_port()
            if port not in self.ports:
                self.ports.append(port)
        self.node_timeout_ms = node_timeout_ms
        self.dir = Path(tempfile.mkdtemp(prefix="tally-cluster-"))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """``COUNTERS_REDIS_URL`` for the cluster: every node, comma-separated."""
        return ",".join(f"redis://127.0.0.1:{port}/0" for port in self.ports)

    def _start_node(self, port: int) -> None:
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [
                binary("server", self.kind),
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--dir", str(node_dir),
                "--save", "",
                "--appendonly", "no",
                "--repl-diskless-sync-delay", "0",
                "--logfile", str(node_dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def start(self) -> RedisCluster:
        for port in self.ports:
            self._start_node(port)
        for i, port in enumerate(list(self.ports)):
            for _ in range(5):
                if self._wait_own(port):
                    break
                # another process took the port between the check and the bind: move
                self.procs.pop(port).wait(10)
                port = self.ports[i] = self._new_port()
                self._start_node(port)
            else:
                raise RuntimeError("could not start a Redis Cluster node on a free port")
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            [
                binary("cli", self.kind),
                "--cluster",
                "create",
                *nodes,
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.wait_ok()
        self.wait_replicas_in_sync()
        return self

    def wait_replicas_in_sync(self, timeout: float = 60) -> None:
        """Until every replica has its link to its master up (a failover needs it)."""
        deadline = time.monotonic() + timeout
        while True:
            replicas = [p for p, flags in self._nodes() if "slave" in flags and "fail" not in flags]
            up = 0
            for port in replicas:
                client = redis.Redis(port=port, decode_responses=True)
                try:
                    up += client.info("replication").get("master_link_status") == "up"
                finally:
                    client.close()
            if replicas and up == len(replicas):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the replicas of the Redis Cluster did not sync")
            time.sleep(0.1)

    def _new_port(self) -> int:
        while True:
            port = cluster_port()
            if port not in self.ports:
                return port

    def _wait_own(self, port: int, timeout: float = 10) -> bool:
        """Until the node on ``port`` answers; False if ours died (its port was taken)."""
        proc = self.procs[port]
        client = redis.Redis(port=port, socket_connect_timeout=0.2, decode_responses=True)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                try:
                    # a server answering that is not ours holds the port: ours cannot bind
                    return int(client.info("server")["process_id"]) == proc.pid
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def _info(self, port: int) -> dict[str, str]:
        client = redis.Redis(port=port, socket_connect_timeout=0.5, decode_responses=True)
        try:
            text = client.execute_command("CLUSTER", "INFO")
        finally:
            client.close()
        if isinstance(text, dict):
            return {str(k): str(v) for k, v in text.items()}
        return dict(line.split(":", 1) for line in text.strip().splitlines() if ":" in line)

    def wait_ok(self, timeout: float = 60) -> None:
        """Until every live node says the cluster is ok and covers all slots."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                infos = [self._info(p) for p, proc in self.procs.items() if proc.poll() is None]
                if all(
                    i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384"
                    for i in infos
                ):
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not become ok")
            time.sleep(0.1)

    def _cluster_nodes(self) -> list[list[str]]:
        """The fields of every line of CLUSTER NODES, as a live node sees them."""
        live = next(p for p, proc in self.procs.items() if proc.poll() is None)
        out = subprocess.run(
            [binary("cli", self.kind), "-p", str(live), "cluster", "nodes"],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return [line.split() for line in out.strip().splitlines()]

    def _nodes(self) -> list[tuple[int, str]]:
        """(port, flags) of every node, as a live node sees them."""
        return [(_port(fields), fields[2]) for fields in self._cluster_nodes()]

    def replica_of(self, port: int) -> int:
        """Port of the replica of master ``port``."""
        lines = self._cluster_nodes()
        [master_id] = [fields[0] for fields in lines if _port(fields) == port]
        [replica] = [_port(fields) for fields in lines if fields[3] == master_id]
        return replica

    def pause(self, port: int) -> None:
        """SIGSTOP one node: it neither answers nor replicates until :meth:`resume`."""
        self.procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

    def masters(self) -> list[int]:
        """Ports of the healthy masters that serve slots now.

        A master whose slots went to its promoted replica (after a failover, or
        a node timeout on a loaded machine) still says "master" until it learns
        it was replaced: it serves no slot, and is not counted.
        """
        return sorted(
            _port(fields)
            for fields in self._cluster_nodes()
            if "master" in fields[2] and "fail" not in fields[2] and len(fields) > 8
        )

    def fail_master(self, port: int | None = None, timeout: float = 60) -> tuple[int, int]:
        """SIGKILL a master and wait until its replica is promoted: (killed, promoted)."""
        before = self.masters()
        port = port or before[0]
        self.kill(port)
        deadline = time.monotonic() + timeout
        while True:
            now = self.masters()
            promoted = [p for p in now if p not in before]
            if port not in now and promoted and len(now) == len(before):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica of {port} was promoted")
            time.sleep(0.05)
        self.wait_ok(timeout)
        return port, promoted[0]

    def kill(self, port: int) -> None:
        """SIGKILL one node."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        if not getattr(self, "keep", False):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
