"""Options and fixtures of the chaos suite.

Quick mode (the default) fits in CI. A soak runs for at least N minutes:

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/chaos \\
        .venv/bin/pytest tests/chaos -s --chaos-soak-minutes 10

``TALLY_CHAOS_MINUTES=10`` does the same where pytest options are awkward.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.harness import CeleryFlusher, CommandFlusher, Config
from tests.procs import project_env
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-soak-minutes",
        type=float,
        default=None,
        metavar="N",
        help="run the chaos suite as a soak of at least N minutes (default: quick mode; "
        "the environment variable TALLY_CHAOS_MINUTES does the same)",
    )


def soak_minutes(config: pytest.Config) -> float:
    value = config.getoption("--chaos-soak-minutes", default=None)
    if value is None and os.environ.get("TALLY_CHAOS_MINUTES"):
        value = float(os.environ["TALLY_CHAOS_MINUTES"])
    return float(value or 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    minutes = soak_minutes(config)
    if minutes:
        here = Path(__file__).parent
        for item in items:
            if Path(item.path).is_relative_to(here):
                # The trial in progress when the time is up still runs to its end.
                item.add_marker(pytest.mark.timeout(minutes * 60 + 600), append=False)


@pytest.fixture
def chaos_config(request) -> Config:
    minutes = soak_minutes(request.config)
    return Config.soak(minutes) if minutes else Config.quick()


@pytest.fixture
def chaos_redis() -> Iterator[RedisServer]:
    """The buffer's Redis: this test's own server, no persistence, restarted by the chaos."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def broker_redis() -> Iterator[RedisServer]:
    """Celery's broker: a server of its own, so restarting the buffer's Redis spares it."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def chaos_settings(settings, chaos_redis, chaos_config, counters_prefix) -> dict[str, str]:
    """The counters settings of the test process, and the same for every subprocess."""
    values = {
        "COUNTERS_REDIS_URL": chaos_redis.url,
        "COUNTERS_SHARDS": str(chaos_config.shards),
        "COUNTERS_BATCH_SIZE": str(chaos_config.batch_size),
        "COUNTERS_LEASE_TIMEOUT": str(chaos_config.lease_timeout),
        "COUNTERS_SOCKET_TIMEOUT": str(chaos_config.socket_timeout),
        "COUNTERS_FLUSH_TIME_BUDGET": "5",
    }
    settings.COUNTERS_REDIS_URL = chaos_redis.url
    settings.COUNTERS_SHARDS = chaos_config.shards
    settings.COUNTERS_BATCH_SIZE = chaos_config.batch_size
    settings.COUNTERS_LEASE_TIMEOUT = chaos_config.lease_timeout
    settings.COUNTERS_SOCKET_TIMEOUT = chaos_config.socket_timeout
    return values


@pytest.fixture
def chaos_settings_module() -> str:
    """The settings of every subprocess: writers and flushers must know the same counters.

    A test module whose writers change counters declared elsewhere (the test
    blog's, in ``tests.settings``) overrides this fixture.
    """
    return "config.settings"


@pytest.fixture
def subprocess_values(chaos_settings, chaos_settings_module) -> dict[str, str]:
    return {**chaos_settings, "DJANGO_SETTINGS_MODULE": chaos_settings_module}


def subprocess_env(values: dict[str, str], application_name: str, **extra: str) -> dict[str, str]:
    return project_env(application_name=application_name, **values, **extra)


@pytest.fixture
def writer_env(subprocess_values) -> dict[str, str]:
    return subprocess_env(subprocess_values, "tally-writer")


@pytest.fixture
def command_flusher(subprocess_values, tmp_path) -> Iterator[CommandFlusher]:
    env = subprocess_env(subprocess_values, CommandFlusher.APP)
    flusher = CommandFlusher([sys.executable, "manage.py"], ROOT, env, tmp_path)
    try:
        yield flusher
    finally:
        flusher.stop(grace=0)


@pytest.fixture
def celery_flusher(subprocess_values, broker_redis, tmp_path) -> Iterator[CeleryFlusher]:
    """A Celery worker (killed and restarted by the chaos); a beat sends the flush every 1 s."""
    from counters.ops.schedule import ensure_periodic_task

    ensure_periodic_task(interval=1)
    env = subprocess_env(subprocess_values, CeleryFlusher.APP, CELERY_BROKER_URL=broker_redis.url)
    beat_env = dict(env, DATABASE_URL=env["DATABASE_URL"].replace(CeleryFlusher.APP, "tally-beat"))
    celery = CeleryFlusher(ROOT, env, beat_env, tmp_path)
    try:
        celery.start_beat()
        yield celery
    finally:
        celery.stop_all()
