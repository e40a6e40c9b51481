"""``/metrics``: off by default, and once on, every series with the values of real operations.

The process counters live as long as the test process, so each test compares
two scrapes, before and after what it does; the scrape-time series (backlog,
lag, epochs) are read from this test's Redis prefix and database.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from unittest import mock

import pytest
from django.db import OperationalError, transaction

import counters
from counters.base import metrics
from counters.base.exceptions import BufferUnavailable, FlushFailed
from counters.client import get_buffer
from counters.models import FlushBatch
from counters.verify.rebuild import rebuild, rebuild_all
from counters.write.delivery import write_direct
from notifications.models import Notification, UnreadCounter
from tests.helpers import stored, truth
from tests.metrics_scrape import PROCESS_FAMILIES, STATE_FAMILIES, Scrape
from tests.write.test_redis_down import silent_server  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

UNREACHABLE = "redis://127.0.0.1:1/0"


@pytest.fixture
def enabled(settings):
    settings.COUNTERS_METRICS = True
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5


def scrape(client, **headers) -> Scrape:
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content[:500]
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "no-cache" in response["Cache-Control"]
    return Scrape.parse(response.content.decode())


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def member(user) -> str:
    return f"unread:{user.pk}"


def test_off_by_default(client, settings):
    assert not hasattr(settings, "COUNTERS_METRICS")
    assert client.get("/metrics").status_code == 404
    settings.COUNTERS_METRICS = False
    assert client.get("/metrics").status_code == 404


def test_the_environment_turns_it_on(client, monkeypatch):
    monkeypatch.setenv("COUNTERS_METRICS", "1")
    assert client.get("/metrics").status_code == 200
    monkeypatch.setenv("COUNTERS_METRICS", "0")
    assert client.get("/metrics").status_code == 404


def test_every_series_once_enabled(client, enabled, make_user):
    Notification.objects.create(recipient=make_user(), verb="x")
    counters.flush()
    result = scrape(client)
    assert set(result.types) == PROCESS_FAMILIES | STATE_FAMILIES
    assert result.value("tally_outbox_rows", database="default") == 0  # durable mode is off
    assert result.value("tally_outbox_oldest_age_seconds", database="default") == 0
    assert "_created" not in result.text
    for line in result.text.splitlines():
        if line.startswith("# HELP "):
            assert len(line.split(" ", 3)[3]) > 20, line
    assert {n for n, t in result.types.items() if t == "counter"} == {
        "tally_flush_runs",
        "tally_flushed_batches",
        "tally_flushed_keys",
        "tally_flushed_deltas",
        "tally_recovered_batches",
        "tally_dropped_keys",
        "tally_fallback_writes",
        "tally_fallback_keys",
        "tally_late_pushes",
        "tally_drift_found",
        "tally_drift_repaired",
        "tally_epoch_losses",
        "tally_outbox_pushed",
        "tally_outbox_repaired",
    }
    assert result.types["tally_flush_duration_seconds"] == "histogram"
    assert result.by_shard("tally_backlog_keys").keys() == set(range(16))
    # Every known label set is there from the start, at 0.
    for outcome in metrics.FLUSH_OUTCOMES:
        result.value("tally_flush_runs_total", outcome=outcome)
    for counter in ("unread", "post_comments", "post_points"):
        assert result.value("tally_drift_repaired_total", counter=counter) >= 0


def test_head_and_openmetrics(client, enabled):
    head = client.head("/metrics")
    assert (head.status_code, head.content) == (200, b"")
    response = client.get("/metrics", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.decode().endswith("# EOF\n")
    assert client.post("/metrics").status_code == 405


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_backlog_then_flush(client, enabled, make_user):
    users = [make_user() for _ in range(5)]
    buffer = get_buffer()
    for i, user in enumerate(users):
        for j in range(i + 1):
            Notification.objects.create(recipient=user, verb=f"{j}")
    Notification.objects.filter(recipient=users[4]).first().mark_read()
    before = scrape(client)
    per_shard = {s: 0 for s in range(buffer.shards)}
    for user in users:
        per_shard[buffer.shard_of(member(user))] += 1
    assert before.by_shard("tally_backlog_keys") == per_shard
    lag = before.by_shard("tally_lag_seconds")
    assert all(lag[s] == 0 for s, n in per_shard.items() if n == 0)
    assert all(lag[s] >= 0 for s in lag)
    assert before.total("tally_inflight_keys") == 0

    result = counters.flush()
    after = scrape(client)
    busy = sum(1 for n in per_shard.values() if n)
    assert (result.batches, result.keys) == (busy, 5)
    assert moved(before, after, "tally_flush_runs_total", outcome="ok") == 1
    assert moved(before, after, "tally_flush_duration_seconds_count") == 1
    assert moved(before, after, "tally_flushed_batches_total") == busy
    assert moved(before, after, "tally_flushed_keys_total") == 5
    # 1 + 2 + 3 + 4 + 5 creates and one read: the deltas net to 14 in 5 keys. The counter is
    # a float of this process: exact, unless earlier tests drove it past 2**53 (one ulp a batch).
    deltas = "tally_flushed_deltas_total"
    ulp = math.ulp(after.value(deltas))
    assert math.isclose(moved(before, after, deltas), 14, rel_tol=0, abs_tol=busy * ulp)
    assert after.total("tally_backlog_keys") == after.total("tally_lag_seconds") == 0
    assert after.value("tally_last_flush_failed_shards") == 0
    assert after.value("tally_flush_in_progress") == 0
    assert [stored(u) for u in users] == [truth(u) for u in users] == [1, 2, 3, 4, 4]
    recorded = float(buffer.client.hget(f"{buffer.prefix}:last_flush", "at"))
    assert after.value("tally_last_flush_timestamp_seconds") == recorded


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_direct_write_moves_the_fallback_counter(client, enabled, settings, make_user):
    alice, bob = make_user(), make_user()
    before = scrape(client)
    settings.COUNTERS_REDIS_URL = UNREACHABLE
    with transaction.atomic():  # one commit, one direct write of two keys
        Notification.objects.create(recipient=alice, verb="x")
        Notification.objects.create(recipient=bob, verb="y")
    assert FlushBatch.objects.filter(kind=FlushBatch.Kind.FALLBACK).count() == 1
    with pytest.raises(BufferUnavailable):
        counters.flush()
    down = scrape(client)
    assert moved(before, down, "tally_fallback_writes_total") == 1
    assert moved(before, down, "tally_fallback_keys_total") == 2
    assert moved(before, down, "tally_flush_runs_total", outcome="redis_unavailable") == 1
    assert down.value("tally_redis_up") == 0
    assert down.value("tally_database_up") == 1
    assert "tally_backlog_keys" not in down.types  # not known while Redis is down
    assert down.value("tally_unsettled_fallbacks") == 0  # refused: the push never left
    assert stored(alice) == stored(bob) == 1


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_late_pushes_fenced_and_taken_back(client, enabled, settings, make_user, silent_server):  # noqa: F811
    alice, bob = make_user(), make_user()
    before = scrape(client)
    settings.COUNTERS_REDIS_URL = silent_server  # the push is sent, then never answered
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    Notification.objects.create(recipient=alice, verb="x")
    del settings.COUNTERS_REDIS_URL
    settings.COUNTERS_SOCKET_TIMEOUT = 0.5
    # Bob's push timed out too, and reached Redis afterwards.
    write_direct({member(bob): 1}, "default", push_id="late", unsettled=True)
    get_buffer().push({member(bob): 1}, "late")
    waiting = scrape(client)
    assert waiting.value("tally_unsettled_fallbacks") == 2

    assert counters.flush().compensated == 1
    after = scrape(client)
    assert moved(before, after, "tally_late_pushes_total", outcome="fenced") == 1
    assert moved(before, after, "tally_late_pushes_total", outcome="taken_back") == 1
    assert after.value("tally_unsettled_fallbacks") == 0
    assert (stored(alice), stored(bob)) == (1, 1)


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_recovered_batch(client, enabled, make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="x")
    buffer = get_buffer()
    shard = buffer.shard_of(member(alice))
    assert buffer.move(shard, "dead-flusher", 1000) is not None  # a flusher died after this
    before = scrape(client)
    assert before.by_shard("tally_inflight_keys")[shard] == 1
    assert before.by_shard("tally_backlog_keys")[shard] == 0
    counters.flush()
    after = scrape(client)
    assert moved(before, after, "tally_recovered_batches_total") == 1
    assert moved(before, after, "tally_flushed_batches_total") == 1
    assert after.by_shard("tally_inflight_keys")[shard] == 0
    assert stored(alice) == 1


def test_failed_shards(client, enabled, make_user):
    users = [make_user() for _ in range(3)]
    for user in users:
        Notification.objects.create(recipient=user, verb="x")
    buffer = get_buffer()
    busy = {buffer.shard_of(member(u)) for u in users}
    before = scrape(client)
    with (
        mock.patch(
            "counters.flushing.shard.apply_deltas", side_effect=OperationalError("lock timeout")
        ),
        pytest.raises(FlushFailed),
    ):
        counters.flush()
    after = scrape(client)
    assert moved(before, after, "tally_flush_runs_total", outcome="shards_failed") == 1
    assert moved(before, after, "tally_flushed_keys_total") == 0
    assert after.value("tally_last_flush_failed_shards") == len(busy)
    assert sum(after.by_shard("tally_inflight_keys").values()) == 3  # stay in flight
    counters.flush()
    assert scrape(client).value("tally_last_flush_failed_shards") == 0


def test_drift_found_and_repaired(client, enabled, make_user):
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="x")
    counters.flush()
    UnreadCounter.objects.filter(user=alice).update(count=7)  # raw corruption
    before = scrape(client)
    report = rebuild("unread", keys=[alice.pk], dry_run=True, confirm_delay=0.01)
    assert len(report.wrong) == 1
    dry = scrape(client)
    assert moved(before, dry, "tally_drift_found_total", counter="unread") == 1
    assert moved(before, dry, "tally_drift_repaired_total", counter="unread") == 0
    assert rebuild("unread", keys=[alice.pk], confirm_delay=0.01).repaired == 1
    after = scrape(client)
    assert moved(dry, after, "tally_drift_found_total", counter="unread") == 1
    assert moved(dry, after, "tally_drift_repaired_total", counter="unread") == 1
    assert moved(before, after, "tally_drift_repaired_total", counter="post_comments") == 0
    counters.flush()
    assert stored(alice) == truth(alice) == 1


def test_drift_the_audit_repairs_is_counted(client, enabled, make_user):
    from counters.verify.audit import audit

    alice, bob = make_user(), make_user()
    for user in (alice, bob, bob):
        Notification.objects.create(recipient=user, verb="x")
    counters.flush()
    UnreadCounter.objects.filter(user=bob).update(count=9)  # raw corruption of one key
    before = scrape(client)
    result = audit(names=["unread"], slice_size=1000, confirm_delay=0.01)
    assert result.repaired == 1
    after = scrape(client)
    assert moved(before, after, "tally_drift_found_total", counter="unread") == 1
    assert moved(before, after, "tally_drift_repaired_total", counter="unread") == 1
    counters.flush()
    assert (stored(alice), stored(bob)) == (truth(alice), truth(bob)) == (1, 2)


def test_an_epoch_loss_until_the_rebuild(client, enabled, settings, make_user):
    settings.COUNTERS_AUTO_REBUILD = False
    alice = make_user()
    Notification.objects.create(recipient=alice, verb="x")
    counters.flush()
    assert scrape(client).value("tally_epoch_losses_total") == 0
    buffer = get_buffer()
    buffer.client.delete(buffer.key(3, "epoch"))  # Redis lost shard 3
    lost = scrape(client)
    assert lost.value("tally_rebuild_needed") == 1  # seen before any flush
    assert lost.value("tally_epoch_losses_total") == 0
    counters.flush()
    found = scrape(client)
    assert found.value("tally_epoch_losses_total") == 1
    assert found.value("tally_rebuild_needed") == 1
    rebuild_all()
    repaired = scrape(client)
    assert repaired.value("tally_epoch_losses_total") == 1
    assert repaired.value("tally_rebuild_needed") == 0


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_a_metric_that_cannot_be_recorded_never_fails_the_write(
    client, enabled, settings, make_user
):
    settings.COUNTERS_REDIS_URL = UNREACHABLE
    alice = make_user()
    with mock.patch.object(metrics.FALLBACK_WRITES, "labels", side_effect=OSError("disk full")):
        Notification.objects.create(recipient=alice, verb="x")
    assert stored(alice) == truth(alice) == 1


def test_the_alerting_rules_name_real_series(client, enabled, make_user):
    Notification.objects.create(recipient=make_user(), verb="x")
    counters.flush()
    names = {name for name, _ in scrape(client).samples}
    rules = (Path(__file__).resolve().parents[2] / "docs" / "tally-alerts.yml").read_text()
    named = set(re.findall(r"\btally_[a-z_]+", rules))
    assert len(named) == 9
    assert named <= names, named - names
