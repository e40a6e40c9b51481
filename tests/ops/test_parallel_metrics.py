"""``/metrics`` is the same whether one process flushes or N tasks do: the flush counters
move by what the parts applied, and the last-flush time is the newest part's, not a stale
manual flush's."""

from __future__ import annotations

import time

import pytest

import counters
from config.celery import app
from counters import tasks
from counters.base import metrics
from counters.client import get_buffer
from counters.models import FlushBatch
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth
from tests.metrics_scrape import Scrape

# Serial: a push that outlasts the socket timeout on a loaded machine falls back to the DB
# (a batch of its own), and these tests count the batches.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]

PARTS = 4


@pytest.fixture
def enabled(settings):
    """Metrics on, the deltas counter from 0: a float of this process, which earlier tests
    that flush deltas near 2**63 leave past 2**53, where adding 39 is no longer exact."""
    settings.COUNTERS_METRICS = True
    metrics.FLUSHED_DELTAS.clear()


@pytest.fixture
def eager(settings):
    """COUNTERS_FLUSH_PARALLELISM = 4, and sent tasks run inline."""
    settings.COUNTERS_FLUSH_PARALLELISM = PARTS
    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = before


def scrape(client) -> Scrape:
    response = client.get("/metrics")
    assert response.status_code == 200, response.content[:500]
    return Scrape.parse(response.content.decode())


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def spread(make_user, count: int = 20) -> list:
    users = [make_user() for _ in range(count)]
    for i, user in enumerate(users):
        for j in range(i % 3 + 1):
            Notification.objects.create(recipient=user, verb=f"n{j}")
    return users


def busy_shards(users) -> int:
    buffer = get_buffer()
    return len({buffer.shard_of(f"unread:{u.pk}") for u in users})


def test_a_parallel_run_moves_the_flush_counters_by_what_its_parts_applied(
    client, enabled, eager, make_user
):
    users = spread(make_user)
    before = scrape(client)
    tasks.flush_counters()
    after = scrape(client)
    assert [(u.pk, stored(u)) for u in users] == [(u.pk, truth(u)) for u in users]
    deltas = sum(truth(u) for u in users)
    assert deltas == 39  # 7 users with 1, 7 with 2, 6 with 3
    assert FlushBatch.objects.count() == busy_shards(users)
    assert moved(before, after, "tally_flushed_batches_total") == busy_shards(users)
    assert moved(before, after, "tally_flushed_keys_total") == len(users)
    assert moved(before, after, "tally_flushed_deltas_total") == deltas
    assert moved(before, after, "tally_flush_runs_total", outcome="ok") == PARTS
    assert moved(before, after, "tally_flush_duration_seconds_count") == PARTS
    assert after.value("tally_flush_in_progress") == 0
    assert after.value("tally_last_flush_failed_shards") == 0


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_the_last_flush_time_is_the_newest_part_not_an_old_manual_flush(
    client, enabled, eager, make_user
):
    spread(make_user, 4)
    counters.flush()  # a manual whole flush, an hour ago
    buffer = get_buffer()
    buffer.client.hset(f"{buffer.prefix}:last_flush", "at", str(time.time() - 3600))
    stale = scrape(client).value("tally_last_flush_timestamp_seconds")
    assert time.time() - stale > 3000
    users = spread(make_user, 8)
    started = time.time()
    tasks.flush_counters()
    fresh = scrape(client).value("tally_last_flush_timestamp_seconds")
    assert started <= fresh <= time.time()
    # A later dispatch whose parts have not reported yet keeps the last part's time.
    from counters.ops.fanout import start_run

    start_run("default", PARTS)
    assert scrape(client).value("tally_last_flush_timestamp_seconds") == fresh
    assert [(u.pk, stored(u)) for u in users] == [(u.pk, truth(u)) for u in users]
    assert UnreadCounter.objects.count() == 12


def test_without_any_part_the_whole_flush_is_the_last_flush(client, enabled, make_user):
    users = spread(make_user, 4)
    started = time.time()
    counters.flush()
    buffer = get_buffer()
    recorded = float(buffer.client.hget(f"{buffer.prefix}:last_flush", "at"))
    assert started <= scrape(client).value("tally_last_flush_timestamp_seconds") == recorded
    assert [stored(u) for u in users] == [truth(u) for u in users]
