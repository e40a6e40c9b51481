"""The production configuration: deploy checks from the environment, and the gunicorn web process.

Each test runs the project as a subprocess with a production-like environment
(``DEBUG=0``, a long secret key, HTTPS settings), the way a server would.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from counters.client import get_client
from tests.procs import ROOT, project_env, run_manage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]

SECURE = {
    "SECURE_SSL_REDIRECT": "1",
    "SECURE_HSTS_SECONDS": "31536000",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": "1",
    "SECURE_HSTS_PRELOAD": "1",
    "SESSION_COOKIE_SECURE": "1",
    "CSRF_COOKIE_SECURE": "1",
}


def production_env(**extra: str) -> dict[str, str]:
    env = project_env(
        DEBUG="0",
        SECRET_KEY=secrets.token_urlsafe(50),
        ALLOWED_HOSTS="tally.example.com,127.0.0.1",
    )
    for name in (*SECURE, "CSRF_TRUSTED_ORIGINS", "SECURE_PROXY_SSL_HEADER", "WEB_CONCURRENCY"):
        env.pop(name, None)
    env.update(extra)
    return env


def test_check_deploy_passes_with_the_secure_settings_on(own_redis):
    get_client().config_set("save", "3600 1")  # a Redis that keeps its data (counters.W020)
    code, out, err = run_manage(
        "check", "--deploy", "--fail-level", "WARNING", env=production_env(**SECURE)
    )
    assert code == 0, out + err
    assert "System check identified no issues" in out


def test_check_deploy_names_each_setting_left_off():
    code, _, err = run_manage("check", "--deploy", "--fail-level", "WARNING", env=production_env())
    assert code == 1
    for check in ("W004", "W008", "W012", "W016"):  # HSTS, SSL redirect, both cookies
        assert f"security.{check}" in err, err
    assert "counters.W001" not in err  # the real Redis answers


SHOW_SETTINGS = (
    "import json; from django.conf import settings; print(json.dumps({"
    "'proxy': getattr(settings, 'SECURE_PROXY_SSL_HEADER', None), "
    "'origins': settings.CSRF_TRUSTED_ORIGINS, 'hsts': settings.SECURE_HSTS_SECONDS}))"
)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param({}, {"proxy": None, "origins": [], "hsts": 0}, id="defaults"),
        pytest.param(
            {
                "SECURE_PROXY_SSL_HEADER": "1",
                "CSRF_TRUSTED_ORIGINS": "https://tally.example.com,https://*.example.org",
                "SECURE_HSTS_SECONDS": "3600",
            },
            {
                "proxy": ["HTTP_X_FORWARDED_PROTO", "https"],
                "origins": ["https://tally.example.com", "https://*.example.org"],
                "hsts": 3600,
            },
            id="set",
        ),
    ],
)
def test_proxy_header_and_trusted_origins_come_from_the_environment(extra, expected):
    code, out, err = run_manage("shell", "-c", SHOW_SETTINGS, env=production_env(**extra))
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == expected


def procfile_command(name: str, process: str) -> str:
    for line in (ROOT / name).read_text().splitlines():
        key, _, command = line.partition(":")
        if key == process:
            return command.strip()
    raise AssertionError(f"no {process} process in {name}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(proc: subprocess.Popen, port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"gunicorn did not listen on {port}")


def fetch(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture
def gunicorn(tmp_path: Path):
    """The web process of Procfile.production, started as a platform would start it."""
    port = free_port()
    env = production_env(PORT=str(port), WEB_CONCURRENCY="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    proc = subprocess.Popen(
        ["sh", "-c", f"exec {procfile_command('Procfile.production', 'web')}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_port(proc, port, time.monotonic() + 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)


def test_production_web_process_serves_the_api_pages_and_static_files(gunicorn):
    status, headers, body = fetch(f"{gunicorn}/api/openapi.json")
    assert status == 200
    assert json.loads(body)["openapi"].startswith("3.")
    assert "no-store" in headers["Cache-Control"]
    length = headers["Content-Length"]
    status, headers, body = fetch(f"{gunicorn}/api/openapi.json", "HEAD")
    assert (status, headers["Content-Length"], body) == (200, length, b"")
    status, headers, body = fetch(f"{gunicorn}/api/notifications/unread-count/")
    assert (status, json.loads(body)) == (401, {"error": "authentication required"})
    status, headers, body = fetch(f"{gunicorn}/static/notifications/tally.css")
    assert (status, headers["Content-Type"]) == (200, 'text/css; charset="utf-8"')
    assert b".notification-actions" in body
    status, headers, body = fetch(f"{gunicorn}/accounts/login/")
    assert (status, headers["X-Frame-Options"]) == (200, "DENY")
    assert b'name="password"' in body
