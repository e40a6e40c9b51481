"""`manage.py counters_bench`: every figure is there and the bench leaves nothing behind.

No timing is asserted: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import numbers
import os

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

import counters
from benchmarks import trigger
from benchmarks.report import TARGETS
from counters.base import conf
from counters.models import BufferEpoch, FlushBatch
from tests.procs import database_url, project_env, run_manage

# The marker makes pytest-django create the test database the module fixture runs the bench on.
pytestmark = pytest.mark.django_db

WORKLOADS = ("spread", "hot")
POSTGRES = connection.vendor == "postgresql"
#: The write modes of a run on this database (the trigger needs PostgreSQL).
MODES = (
    *("off", "naive", *(("trigger",) if POSTGRES else ())),
    *("tally", "per_commit", "durable", "sender", "batched", "waited"),
    *("floor", "floor_push", "floor_durable"),
)
#: Ratios of a run: those of the trigger on PostgreSQL only.
RATIOS = (
    *("tally_off", "tally_naive", "durable_off", "durable_tally", "sender_off", "sender_tally"),
    *("per_commit_off", "tally_per_commit"),
    *("waited_off", "waited_tally", "tally_waited", "floor_off", "floor_tally", "tally_floor"),
    *("floor_durable_off", "durable_floor_durable", "batched_off", "batched_tally"),
    *("batched_floor", "floor_push_off", "tally_floor_push"),
    *(("trigger_off", "tally_trigger", "floor_trigger", "batched_trigger") if POSTGRES else ()),
    *(("floor_push_trigger",) if POSTGRES else ()),
)
#: Per-insert costs measured only on PostgreSQL (backend CPU: when the server is local).
SERVER_COSTS = ("backend_cpu_us", "wal_bytes")
#: Modes whose inserts send something to Redis: its CPU per insert is above 0.
PUSHING = (
    *("tally", "per_commit", "durable", "sender", "batched", "waited"),
    *("floor", "floor_push", "floor_durable"),
)
FIGURES = [
    ("machine", "nproc"),
    ("machine", "memory_mb"),
    *[("writes", w, f"{m}_ops_per_s") for w in WORKLOADS for m in MODES],
    *[("writes", w, ratio) for w in WORKLOADS for ratio in RATIOS],
    *[("writes", w, f"{m}_{p}_ms") for w in WORKLOADS for m in MODES for p in ("p50", "p99")],
    *[("writes", w, f"{m}_writer_cpu_us") for w in WORKLOADS for m in MODES],
    *[("writes", w, f"{m}_wal_bytes") for w in WORKLOADS for m in MODES if POSTGRES],
    *[("writes", w, f"{m}_redis_cpu_us") for w in WORKLOADS for m in PUSHING],
    *[
        ("writes", w, f)
        for w in WORKLOADS
        for base in ("redis_cpu_us_per_push", "evalsha_per_commit", "evalsha_usec_per_call")
        for f in (base, f"sender_{base}", f"batched_{base}", f"floor_push_{base}")
    ],
    ("writes", "send_delay_ms"),
    ("flush", "flush_keys_per_s"),
    ("flush", "raw_keys_per_s"),
    ("flush", "flush_raw"),
    ("flush", "raw_sequential_keys_per_s"),
    ("flush", "flush_raw_sequential"),
    *[("parallel", "workers", n, "keys_per_s") for n in ("1", "2", "4")],
    *[("parallel", "speedup", n) for n in ("1", "2", "4")],
    ("reads", "get_count_ms"),
    ("reads", "count_ms"),
    ("reads", "count_get_count"),
    *[
        ("async", "designs", d, c, f)
        for d in ("hop", "native")
        for c in ("1", "8")
        for f in ("reads_per_s", "cpu_us_per_read")
    ],
    ("memory", "small", "peak_mb"),
    ("memory", "large", "peak_mb"),
    *[
        ("idempotency", "runs", n, scheme, figure)
        for n in ("2000", "6000")
        for scheme in ("old", "new")
        for figure in ("idempotency_keys", "idempotency_bytes", "pushes_per_s")
    ],
]


def dig(data: dict, path: tuple[str, ...]):
    for part in path:
        assert isinstance(data, dict) and part in data, f"missing {'.'.join(path)}"
        data = data[part]
    return data


def leftovers(prefix: str) -> dict[str, int]:
    """Rows and Redis keys a bench run with ``prefix`` could leave behind."""
    return {
        "users": get_user_model().objects.filter(username__startswith=prefix).count(),
        "epochs": BufferEpoch.objects.filter(prefix=prefix).count(),
        "ledger": FlushBatch.objects.count(),
        "redis": len(list(counters.get_client().scan_iter(match=f"{prefix}:*"))),
    }


@pytest.fixture(scope="module")
def quick_run(django_db_setup, django_db_blocker) -> tuple[dict, dict, dict]:
    """The JSON of one quick run, its writes at 1 and 2 writers, and what was left over
    before and after it."""
    with django_db_blocker.unblock():
        before = leftovers("bench-")
        env = {**os.environ, "DATABASE_URL": database_url(), "PYTHONUNBUFFERED": "1"}
        args = ("counters_bench", "--quick", "--processes", "2,1", "--json")
        code, out, err = run_manage(*args, env=env, timeout=280)
        assert code == 0, err
        data = json.loads(out)
        after = leftovers(data["key_prefix"])
    return data, before, after


@pytest.mark.redis
@pytest.mark.parametrize("path", FIGURES, ids=[".".join(p) for p in FIGURES])
def test_quick_json_has_every_figure(quick_run, path):
    value = dig(quick_run[0], path)
    assert isinstance(value, numbers.Real) and not isinstance(value, bool)
    assert value > 0


@pytest.mark.redis
def test_quick_json_checks_and_targets(quick_run):
    quick_run, _, _ = quick_run
    assert quick_run["config"]["quick"] is True
    assert quick_run["reads"]["exact"] is True
    assert quick_run["async"]["exact"] is True
    assert quick_run["writes"]["tally_deltas_match"] is True
    # every insert of the floor mode sent its INCR: their keys add up to its inserts
    assert quick_run["writes"]["floor_ops"] > 0
    assert quick_run["writes"]["floor_sent_match"] is True
    # every insert of the floor_push mode was pushed once and applied by the push script
    assert quick_run["writes"]["floor_push_ops"] > 0
    assert quick_run["writes"]["floor_push_sent_match"] is True
    assert quick_run["writes"]["durable_ops"] > 0
    # every durable write's push applied: the flush's DELETE took each row
    assert quick_run["writes"]["outbox_rows_applied"] > 0
    assert quick_run["writes"]["outbox_rows_left"] == 0
    assert isinstance(dig(quick_run, ("memory", "growth_mb")), numbers.Real)
    for key in ("database", "redis"):
        assert quick_run["machine"][key]
    assert len(quick_run["load_start"]) == len(quick_run["load_end"]) == 3
    # the trigger's and the database's costs are measured on (a local) PostgreSQL only
    assert [t["name"] for t in quick_run["targets"]] == [
        t.name for t in TARGETS if POSTGRES or not ("trigger" in t.name or t.per)
    ]
    assert all(isinstance(t["met"], bool) for t in quick_run["targets"])
    # a target of the writes is shown beside the same figure of its floor mode, in the run
    writes = quick_run["writes"]
    for t in quick_run["targets"]:
        workload = t["name"].rsplit(" ", 1)[1]
        if t["name"].startswith(("tally/off", "tally/trigger", "durable/off")):
            assert t["floor_value"] == writes[workload][t["floor"]]
            assert t["floor_met"] is (t["floor_value"] >= t["threshold"])
        elif t["name"].startswith("tally ") and "/off" in t["name"]:  # a cost over off's
            figure = t["floor"].removeprefix("floor_push_")
            off = writes[workload][f"off_{figure}"]
            assert t["value"] == round(writes[workload][f"tally_{figure}"] / off, 3)
            assert t["floor_value"] == round(writes[workload][t["floor"]] / off, 3)
            assert t["met"] is (t["value"] <= 1.05)


@pytest.mark.redis
def test_quick_json_trigger_mode_counts_exactly_or_says_why_it_was_skipped(quick_run):
    writes = quick_run[0]["writes"]
    if not POSTGRES:
        assert writes["trigger_skipped"] == trigger.unsupported()
        assert "trigger_ops_per_s" not in writes["hot"] and "trigger_ops" not in writes
        for w in WORKLOADS:
            for m in MODES:
                assert [writes[w][f"{m}_{c}"] for c in SERVER_COSTS] == [None, None]
        return
    assert writes["trigger_ops"] > 0
    assert writes["trigger_counted_rows"] == writes["trigger_ops"]  # every insert was unread
    assert writes["trigger_users_off"] == 0
    assert writes["trigger_counts_exact"] is True
    assert writes["trigger_left_installed"] is False
    # Backend CPU: a number when the server is on this machine, else None with the reason.
    for w in WORKLOADS:
        for m in MODES:
            value = writes[w][f"{m}_backend_cpu_us"]
            if writes["backend_cpu_na"] is None:
                assert isinstance(value, float) and value >= 0
            else:
                assert value is None


def tally_setting(per_commit: str) -> str:
    """The push setting the ``tally`` mode shows: the tests' own ``COUNTERS_SEND_DELAY_MS``."""
    delay = conf.get("COUNTERS_SEND_DELAY_MS") or 0
    if delay > 0:
        return f"COUNTERS_SEND_DELAY_MS {delay:g} / COUNTERS_SEND_BATCH {conf.send_batch()}"
    return per_commit


@pytest.mark.redis
def test_quick_json_has_the_cost_of_an_insert_and_the_push_setting_of_every_mode(quick_run):
    writes = quick_run[0]["writes"]
    deferred = conf.defer_acks()  # the bench runs with the settings of the tests
    for count, result in writes["by_processes"].items():
        for w in WORKLOADS:
            for m in MODES:
                costs = {c: result[w][f"{m}_{c}"] for c in ("writer_cpu_us", "redis_cpu_us")}
                if POSTGRES and result["backend_cpu_na"] is None:
                    costs["backend_cpu_us"] = result[w][f"{m}_backend_cpu_us"]
                if POSTGRES:
                    costs["wal_bytes"] = result[w][f"{m}_wal_bytes"]
                for name, value in costs.items():
                    assert isinstance(value, float) and math.isfinite(value), (count, w, m, name)
                    # Redis's CPU in a mode that sends nothing is its own idle work: maybe 0.0
                    assert value > 0 or (name == "redis_cpu_us" and m not in PUSHING), (
                        count,
                        w,
                        m,
                        name,
                        value,
                    )
        pushes = result["push_settings"]
        assert sorted(pushes) == sorted(MODES), count
        # tally runs with the delay of the tests' settings; per_commit and durable push once
        # per commit (their reply read later, or waited for, as the settings of the run say);
        # the sender queues for --send-delay (5 ms)
        per_commit = "off: one push per commit" + ("" if deferred else ", its reply waited for")
        assert pushes["tally"] == tally_setting(per_commit)
        assert pushes["per_commit"] == per_commit
        assert pushes["durable"] == f"{per_commit}; outbox row per commit"
        assert pushes["sender"] == (
            f"COUNTERS_SEND_DELAY_MS 5 / COUNTERS_SEND_BATCH {conf.send_batch()}"
        )
        assert pushes["waited"] == "off: one push per commit, its reply waited for"
        assert pushes["batched"] == "off: one push per commit, COUNTERS_WRITE_BATCH 16 a write"
        assert pushes["off"] == pushes["naive"] == "no push"


@pytest.mark.redis
def test_bench_leaves_no_data_behind(quick_run):
    data, before, after = quick_run
    assert data["key_prefix"].startswith("bench-")
    assert after == {"users": 0, "epochs": 0, "ledger": before["ledger"], "redis": 0}
    if POSTGRES:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_trigger WHERE tgname LIKE %s", [trigger.NAME_PATTERN]
            )
            assert cursor.fetchone()[0] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(("--processes", "0"), "--processes must be at least 1, got 0", id="processes"),
        pytest.param(
            ("--processes", "2,x"),
            "--processes takes a number or comma-separated numbers of at least 1, got '2,x'",
            id="processes-list",
        ),
        pytest.param(
            ("--processes", "2,0"),
            "--processes takes a number or comma-separated numbers of at least 1, got '2,0'",
            id="processes-zero-in-list",
        ),
        pytest.param(("--seconds", "0"), "--seconds must be greater than 0, got 0.0", id="seconds"),
        pytest.param(("--rounds", "-2"), "--rounds must be at least 1, got -2", id="rounds"),
        pytest.param(
            ("--sections", "writes,nope"),
            "--sections takes names from writes,flush,parallel,reads,async,memory,idempotency, "
            "got 'writes,nope'",
            id="sections",
        ),
        pytest.param(("--pushes", "0"), "--pushes must be at least 1, got 0", id="pushes"),
        pytest.param(
            ("--send-delay", "0"), "--send-delay must be in (0, 1000] ms, got 0", id="send-delay"
        ),
        pytest.param(
            ("--flush-workers", "1,0"),
            "--flush-workers takes comma-separated numbers of at least 1, got '1,0'",
            id="flush-workers",
        ),
    ],
)
def test_bad_arguments_exit_non_zero_with_one_line(args, message):
    code, out, err = run_manage("counters_bench", *args)
    assert code != 0
    assert err.strip().splitlines() == [f"CommandError: {message}"]
    assert out == ""


def test_redis_url_option_names_the_redis_of_the_run():
    code, out, err = run_manage(
        "counters_bench", "--quick", "--redis-url", "redis://127.0.0.1:1/0", "--sections", "flush"
    )
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("CommandError: Redis unreachable at redis://127.0.0.1:1/0: ")
    assert out == ""


@pytest.mark.skipif(
    "COUNTERS_REDIS_CLUSTER" in conf.SETTINGS, reason="this version supports Redis Cluster"
)
def test_cluster_option_says_when_cluster_support_is_missing():
    code, out, err = run_manage("counters_bench", "--quick", "--cluster")
    assert code != 0
    assert err.strip().splitlines() == [
        "CommandError: --cluster needs Redis Cluster support (the COUNTERS_REDIS_CLUSTER "
        "setting), which this version of counters does not have"
    ]
    assert out == ""


def test_unreachable_redis_exits_non_zero_with_one_line():
    env = project_env(COUNTERS_REDIS_URL="redis://127.0.0.1:1/0")
    code, out, err = run_manage("counters_bench", "--quick", "--json", env=env)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("CommandError: Redis unreachable at redis://127.0.0.1:1/0")
    assert out == ""


@pytest.fixture(scope="module")
def idempotency_run(django_db_setup, django_db_blocker) -> dict:
    """The JSON of a quick run of the idempotency section alone, 1,500 pushes."""
    with django_db_blocker.unblock():
        env = {**os.environ, "DATABASE_URL": database_url(), "PYTHONUNBUFFERED": "1"}
        code, out, err = run_manage(
            "counters_bench",
            "--quick",
            "--json",
            "--sections",
            "idempotency",
            "--pushes",
            "1500",
            env=env,
            timeout=280,
        )
    assert code == 0, err
    return json.loads(out)


@pytest.mark.redis
def test_idempotency_section_old_markers_grow_and_new_marks_stay_flat(idempotency_run):
    """Per-push markers against writer marks, side by side on prefixes of their own."""
    data = idempotency_run
    idem = data["idempotency"]
    shards, threads = idem["shards"], idem["threads"]
    assert (idem["pushes"], threads, shards) == (1500, 4, conf.shards())
    runs = idem["runs"]
    assert sorted(runs) == ["1500", "4500"]
    for size, by_scheme in runs.items():
        old, new = by_scheme["old"], by_scheme["new"]
        # One delta a push: the old scheme leaves one marker per push.
        assert old["idempotency_keys"] == old["pushes"] == new["pushes"] == int(size)
        assert old["idempotency_bytes"] >= 50 * int(size)
        # The new one a mark per writer and shard: at most shards x threads, however many.
        assert 1 <= new["writers"] <= threads
        assert 1 <= new["idempotency_keys"] <= shards * new["writers"]
        assert new["idempotency_bytes"] < old["idempotency_bytes"] / 10
        assert isinstance(old["used_memory_freed"], int)
        assert isinstance(new["used_memory_freed"], int)
        # Both counted every push.
        assert old["pending_members"] == new["pending_members"] == idem["members"]
    assert idem["new_flat"] is True
    assert idem["old_growth"] == 3.0
    assert runs["4500"]["new"]["idempotency_keys"] <= shards * threads
    assert not list(counters.get_client().scan_iter(match=f"{data['key_prefix']}:*"))


@pytest.fixture(scope="module")
def sweep_table(django_db_setup, django_db_blocker) -> str:
    """The table of a quick run of the writes alone at 1 and 2 writers."""
    with django_db_blocker.unblock():
        env = {**os.environ, "DATABASE_URL": database_url(), "PYTHONUNBUFFERED": "1"}
        args = ("counters_bench", "--quick", "--sections", "writes", "--processes", "2,1")
        code, table, err = run_manage(*args, env=env, timeout=280)
        assert code == 0, err
    return table


@pytest.mark.redis
def test_processes_sweep_measures_every_count_in_one_run(quick_run):
    data, _, _ = quick_run
    writes = data["writes"]
    assert data["config"]["process_counts"] == [1, 2]
    assert data["config"]["processes"] == 2
    assert sorted(writes["by_processes"]) == ["1", "2"]
    for count, result in writes["by_processes"].items():
        assert result["processes"] == int(count)
        for workload in WORKLOADS:
            for mode in ("off", "naive", "tally"):
                figures = result[workload]
                assert figures[f"{mode}_ops_per_s"] > 0
                assert 0 < figures[f"{mode}_p50_ms"] <= figures[f"{mode}_p99_ms"]
            assert figures["evalsha_per_commit"] > 0
    # The top level is the largest count (what the targets read); every insert was counted once.
    assert writes["hot"] == writes["by_processes"]["2"]["hot"]
    assert writes["tally_deltas_match"] is True


@pytest.mark.redis
def test_processes_sweep_prints_one_table_with_a_row_per_count_and_workload(sweep_table):
    lines = sweep_table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("procs"))
    for column in ("trigger", "tally/off", "trigger/off", "tally/trigger"):
        assert column in lines[header].split()
    assert "tally p50/p99" in lines[header]
    rows = [line.split()[:2] for line in lines[header + 1 : header + 5]]
    assert rows == [["1", "spread"], ["1", "hot"], ["2", "spread"], ["2", "hot"]]
    costs = next(i for i, line in enumerate(lines) if line.startswith("cost per insert"))
    assert lines[costs + 1].split()[4:] == list(MODES)
    # procs (6 wide), workload (9), the figure (16), then one column per mode
    labels = [line[15:31].strip() for line in lines[costs + 2 :] if line[:1].isdigit()]
    figures = ["writer CPU µs", "backend CPU µs", "WAL bytes", "Redis CPU µs"]
    assert labels[:16] == figures * 4
    # Every figure in every mode's column: a number, or n/a where it cannot be measured here
    for line in lines[costs + 2 : costs + 18]:
        cells = line[31:].split()
        assert len(cells) == len(MODES), line
        assert all(cell == "n/a" or float(cell) >= 0 for cell in cells), line
    # Redis's CPU is sampled in every mode: a figure above 0 where the inserts send to Redis
    redis_row = next(line for line in lines[costs + 2 :] if line[15:31].strip() == figures[3])
    by_mode = dict(zip(MODES, redis_row.split()[5:], strict=True))  # after "Redis CPU µs"
    assert all(float(by_mode[m]) > 0 for m in PUSHING), redis_row
    # and the merged-push setting of each mode, as its writers reported it
    pushes = lines.index("merged pushes: how each mode's commits reached Redis in its writers")
    shown = dict(line.split(None, 1) for line in lines[pushes + 1 : pushes + 1 + len(MODES)])
    assert sorted(shown) == sorted(MODES)
    assert shown["tally"].startswith(tally_setting("off: one push per commit"))
    assert shown["per_commit"].startswith("off: one push per commit")
    assert shown["sender"].startswith("COUNTERS_SEND_DELAY_MS 5 / COUNTERS_SEND_BATCH ")
    if POSTGRES:
        assert any(line.startswith("trigger: ") and line.endswith(": yes") for line in lines)
    else:
        assert f"note: {trigger.unsupported()}" in lines


def test_percentile_is_the_nearest_rank():
    from benchmarks.writers import percentile

    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99)) == (50.0, 99.0)
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([], 0.5) == 0.0
