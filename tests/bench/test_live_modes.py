"""The live write modes of `manage.py counters_bench --modes`: a live counter, watched or not.

No timing is asserted: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import os

import pytest

import counters
from benchmarks.watchers import Watcher, channels
from benchmarks.writers import DEFAULT_MODES, LIVE_MODES, MODES
from tests.procs import database_url, run_manage

pytestmark = pytest.mark.django_db

WORKLOADS = ("spread", "hot")
RUN_MODES = ("tally", "live", "watched")


@pytest.fixture(scope="module")
def live_run(django_db_setup, django_db_blocker) -> tuple[dict, str]:
    """The JSON and the table of quick runs of tally, live and watched, 2 rounds, each
    COMMIT pushed at once (``COUNTERS_SEND_DELAY_MS`` 0): one message per watched insert."""
    with django_db_blocker.unblock():
        env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "PYTHONUNBUFFERED": "1",
            "COUNTERS_SEND_DELAY_MS": "0",
        }
        args = ("counters_bench", "--quick", "--sections", "writes", "--rounds", "2")
        code, out, err = run_manage(
            *args, "--modes", "watched,live,tally", "--json", env=env, timeout=280
        )
        assert code == 0, err
        code, table, err = run_manage(*args, "--modes", "tally,watched", env=env, timeout=280)
        assert code == 0, err
    return json.loads(out), table


def test_live_modes_are_measured_only_when_asked_for():
    assert set(LIVE_MODES) <= set(MODES)
    assert not set(LIVE_MODES) & set(DEFAULT_MODES)
    assert set(DEFAULT_MODES) | set(LIVE_MODES) == set(MODES)


@pytest.mark.redis
def test_live_modes_count_every_insert_once_and_every_watched_insert_is_delivered(live_run):
    writes = live_run[0]["writes"]
    assert writes["modes"] == list(RUN_MODES)  # in the bench's order, whatever the option's
    assert writes["tally_ops"] > 0
    assert writes["tally_deltas_match"] is True  # tally, live and watched inserts, each once
    # the watcher got one message per watched insert (spread over 1,000 users: all watched)
    assert writes["watched_ops"] > 0
    assert writes["watched_messages"] == writes["watched_ops"]
    assert "trigger_ops" not in writes and "floor_ops" not in writes
    # the same pushes as tally's, each also published
    for mode in LIVE_MODES:
        assert writes["push_settings"][mode] == (
            f"{writes['push_settings']['tally']}; live: each push publishes its member"
        )


@pytest.mark.redis
@pytest.mark.parametrize("workload", WORKLOADS)
def test_live_modes_have_their_costs_and_what_they_add_to_tally(live_run, workload):
    figures = live_run[0]["writes"][workload]
    for mode in RUN_MODES:
        assert figures[f"{mode}_ops_per_s"] > 0
        for cost in ("writer_cpu_us", "redis_cpu_us"):
            assert math.isfinite(figures[f"{mode}_{cost}"]) and figures[f"{mode}_{cost}"] > 0
        for cost in ("writer_cpu_rounds", "redis_cpu_rounds"):
            runs = figures[f"{mode}_{cost}"]
            assert len(runs) == 2 and all(math.isfinite(v) and v > 0 for v in runs), runs
    for mode in LIVE_MODES:
        assert figures[f"{mode}_tally"] > 0
        assert figures[f"{mode}_redis_cpu_us_per_push"] > 0
        for cost in ("writer_cpu", "redis_cpu"):
            added = figures[f"{mode}_added_{cost}_us"]
            runs = zip(
                figures[f"{mode}_{cost}_rounds"], figures[f"tally_{cost}_rounds"], strict=True
            )
            diffs = sorted(m - t for m, t in runs)
            assert math.isclose(added, sum(diffs) / 2, abs_tol=0.11)  # the median of two


@pytest.mark.redis
def test_live_table_shows_every_round_and_what_is_added_to_tally(live_run):
    lines = live_run[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("live counter: "))
    rows = [line.split() for line in lines[start + 1 :] if line[:1].isdigit()]
    rounds = [r for r in rows if "added" not in r]
    # per workload: writer CPU and Redis CPU of tally and watched, one cell per round
    assert [(r[1], r[2], r[4]) for r in rounds] == [
        (w, figure, mode)
        for w in WORKLOADS
        for figure in ("writer", "Redis")
        for mode in ("tally", "watched")
    ]
    assert all(len(r) == 7 and all(float(v) > 0 for v in r[5:]) for r in rounds)
    added = [line for line in lines[start:] if line[:1].isdigit() and "added to tally: " in line]
    assert len(added) == 2 and all("watched writer " in line for line in added)
    assert any(line.startswith("watched: ") and line.endswith(": yes") for line in lines)


def test_unknown_mode_exits_non_zero_with_one_line():
    code, out, err = run_manage("counters_bench", "--modes", "tally,nope")
    assert code != 0
    assert err.strip().splitlines() == [
        f"CommandError: --modes takes names from {','.join(MODES)}, got 'tally,nope'"
    ]
    assert out == ""


@pytest.mark.redis
def test_watcher_receives_each_message_of_its_channels_until_stopped(counters_prefix):
    from counters.base import conf

    client = counters.get_client()
    watched = channels(counters_prefix, 16, "unread", range(1, 2001))
    assert len(set(watched)) == 2000 and watched[0].startswith(f"{counters_prefix}:{{s")
    watcher = Watcher(conf.redis_url(), client, watched)
    with watcher:
        # every channel subscribed, the last batch's too: one receiver each
        assert [client.execute_command("SPUBLISH", c, "") for c in watched[::97]] == [1] * 21
        assert client.execute_command("SPUBLISH", f"{counters_prefix}:other", "") == 0
    assert watcher.messages == 21
    assert client.execute_command("SPUBLISH", watched[0], "") == 0  # ended: no receiver
    with watcher:
        client.execute_command("SPUBLISH", watched[-1], "")
    assert watcher.messages == 22
