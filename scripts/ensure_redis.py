"""Make sure a Redis server answers at REDIS_URL; start a local one if possible.

Exit 0 when Redis answers (already, or after starting ``redis-server`` for a
local URL), else exit 1 with one line that says how to get one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import redis

URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
VAR = Path(os.environ.get("TALLY_VAR_DIR", Path(__file__).resolve().parent.parent / "var"))


def answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def main() -> int:
    if answers(URL):
        return 0
    parsed = urlparse(URL)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    server = shutil.which("redis-server")
    if host not in ("127.0.0.1", "localhost", "::1") or server is None:
        print(
            f"No Redis answers at {URL}. Install one (Debian/Ubuntu: apt-get install "
            "redis-server; macOS: brew install redis) or point REDIS_URL at a running server.",
            file=sys.stderr,
        )
        return 1
    VAR.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            server,
            "--daemonize",
            "yes",
            "--bind",
            host,
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(VAR),
            "--logfile",
            str(VAR / f"redis-{port}.log"),
            "--pidfile",
            str(VAR / f"redis-{port}.pid"),
        ],
        check=True,
    )
    for _ in range(50):
        if answers(URL):
            print(
                f"started redis-server on {host}:{port} (log: {VAR}/redis-{port}.log; "
                f"stop it with: kill $(cat {VAR}/redis-{port}.pid))"
            )
            return 0
        time.sleep(0.1)
    print(f"redis-server did not answer at {URL}; see {VAR}/redis-{port}.log", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
