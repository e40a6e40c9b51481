"""`counters_bench --redis-url unix://…`: the writes measured on a Redis reached over a Unix
socket, every mode, the floor modes included (the unread counter's exact values over the
socket are tests/write/test_unix_socket.py's)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.procs import database_url, run_manage
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.django_db, pytest.mark.redis]


@pytest.fixture(scope="module")
def unix_run(django_db_setup, django_db_blocker) -> tuple[dict, str]:
    """The JSON of a tiny run of the writes section on a Redis of its own, on a socket."""
    folder = Path(tempfile.mkdtemp(prefix="tally-"))  # a socket's path is at most 107 bytes
    try:
        with RedisServer(unix_socket=folder / "redis.sock") as server, django_db_blocker.unblock():
            env = {**os.environ, "DATABASE_URL": database_url(), "PYTHONUNBUFFERED": "1"}
            args = ("--quick", "--processes", "1", "--rounds", "1", "--sections", "writes")
            code, out, err = run_manage(
                "counters_bench", *args, "--json", "--redis-url", server.url, env=env, timeout=280
            )
            assert code == 0, err
            return json.loads(out), str(server.unix_socket)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_run_names_the_socket_as_its_redis(unix_run):
    data, path = unix_run
    assert data["redis"] == {"nodes": [path], "cluster": False}


@pytest.mark.parametrize("workload", ["spread", "hot"])
def test_every_mode_ran_on_the_socket_the_floors_included(unix_run, workload):
    writes = unix_run[0]["writes"][workload]
    for mode in ("off", "tally", "durable", "sender", "waited", "floor", "floor_push"):
        assert writes[f"{mode}_ops_per_s"] > 0, mode
    assert writes["redis_cpu_us_per_push"] > 0  # INFO cpu of the server on the socket
