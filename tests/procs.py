"""Run project commands as real subprocesses against the test database and Redis prefix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, urlencode

from django.conf import settings
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def database_url(application_name: str | None = None) -> str:
    """URL of the database the tests run on (the test database, not the configured one).

    ``application_name`` (PostgreSQL) names the subprocess's connections in
    ``pg_stat_activity``; dj-database-url passes it on as a connection option
    (other databases have no such name: it is left out).
    """
    s = connection.settings_dict
    if connection.vendor == "postgresql":
        host = s.get("HOST") or "127.0.0.1"
        port = s.get("PORT") or 5432
        user = quote(s.get("USER") or "")
        if s.get("PASSWORD"):
            user += ":" + quote(s["PASSWORD"])
        url = f"postgres://{user}@{host}:{port}/{s['NAME']}"
        if application_name:
            url += "?" + urlencode({"application_name": application_name})
        return url
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    if connection.vendor == "mysql":
        user = quote(s.get("USER") or "")
        if s.get("PASSWORD"):
            user += ":" + quote(s["PASSWORD"])
        return f"mysql://{user}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 3306}/{s['NAME']}"
    raise NotImplementedError(connection.vendor)


def project_env(*, application_name: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url(application_name),
        COUNTERS_KEY_PREFIX=settings.COUNTERS_KEY_PREFIX,
        # The project's settings, with the one test database above (not tests.settings).
        DJANGO_SETTINGS_MODULE="config.settings",
        PYTHONUNBUFFERED="1",
    )
    for name in (
        "COUNTERS_REDIS_URL",
        "COUNTERS_REDIS_CLUSTER",
        "COUNTERS_REDIS_SENTINELS",
        "COUNTERS_REDIS_SENTINEL_SERVICE",
        "COUNTERS_SOCKET_TIMEOUT",
        "COUNTERS_BATCH_SIZE",
        "COUNTERS_SEND_DELAY_MS",  # a test's own (per_commit: 0), else the processes' default
    ):
        if hasattr(settings, name):
            value = getattr(settings, name)
            env[name] = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
    env.update(extra)
    return env


def manage(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=popen.pop("env", None) or project_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def run_manage(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    proc = manage(*args, env=env or project_env())
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err
