"""Parallel flush bookkeeping: shard sets of the parts, and the record of a run (fakeredis)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from counters import fanout
from counters.buffer import Buffer
from counters.fanout import last_run, partition, record_part, run_key
from counters.flusher import FlushResult, chosen_shards
from counters.status import last_flush


@pytest.mark.parametrize(
    ("shards", "parts"),
    [(16, 1), (16, 2), (16, 3), (16, 4), (16, 16), (16, 40), (1, 4), (7, 2)],
    ids=lambda v: str(v),
)
def test_parts_are_disjoint_non_empty_and_cover_every_shard(shards, parts):
    sets = partition(shards, parts)
    assert len(sets) == min(shards, parts)
    assert all(sets)
    flat = [s for part in sets for s in part]
    assert sorted(flat) == list(range(shards))  # each shard once
    assert max(map(len, sets)) - min(map(len, sets)) <= 1  # balanced


def test_part_i_takes_every_nth_shard():
    assert partition(8, 3) == [[0, 3, 6], [1, 4, 7], [2, 5]]


@pytest.mark.parametrize(("shards", "parts"), [(0, 2), (16, 0), (16, -1)])
def test_partition_refuses_nothing_to_split(shards, parts):
    with pytest.raises(ValueError, match="need at least 1 shard and 1 part"):
        partition(shards, parts)


@pytest.mark.parametrize(
    ("shards", "message"),
    [
        pytest.param([16], r"shards \[16\] are not shards of this buffer \(0 to 15\)", id="high"),
        pytest.param([-1, 3], r"shards \[-1\]", id="negative"),
        pytest.param(["1"], r"shards \['1'\]", id="string"),
        pytest.param([True], r"shards \[True\]", id="bool"),
        pytest.param([], "no shards to flush", id="empty"),
    ],
)
def test_the_engine_refuses_shards_the_buffer_does_not_have(client, shards, message):
    with pytest.raises(ValueError, match=message):
        chosen_shards(Buffer(client, "p", 16), shards)


def test_the_engine_takes_shards_sorted_once(client):
    buffer = Buffer(client, "p", 16)
    assert chosen_shards(buffer, [5, 1, 5, 0]) == [0, 1, 5]
    assert chosen_shards(buffer, None) == list(range(16))


def start(buffer: Buffer, run: str, parts: int, at: float) -> None:
    buffer.client.delete(run_key(buffer))
    buffer.client.hset(run_key(buffer), mapping={"id": run, "parts": parts, "at": at})


@pytest.fixture
def part(monkeypatch):
    """``part(buffer, run, index, parts, at, **counts)``: record a part that ended at ``at``."""

    def record(buffer: Buffer, run: str, index: int, parts: int, at: float, **counts) -> None:
        monkeypatch.setattr(fanout, "time", SimpleNamespace(time=lambda: at))
        record_part(buffer, run, index, parts, [index], FlushResult(**counts))

    return record


@pytest.fixture
def buffer(client) -> Buffer:
    return Buffer(client, "p", 16)


def test_a_run_adds_up_the_parts_that_reported(buffer, part):
    start(buffer, "r1", 3, at=100.0)
    part(buffer, "r1", 0, 3, at=100.5, batches=2, keys=30, busy_shards=[3])
    part(buffer, "r1", 2, 3, at=101.25, batches=1, keys=5, failed_shards={"6": "boom"})
    run = last_run(buffer)
    assert run is not None
    assert (run["batches"], run["keys"], run["busy_shards"], run["failed_shards"]) == (
        3,
        35,
        [3],
        {"6": "boom"},
    )
    assert run["seconds"] == 1.25  # dispatch to the last report: the parts ran side by side
    assert run["at"] == 101.25
    assert run["parallel"] == {
        "run": "r1",
        "parts": 3,
        "reported": 2,
        "shards": {"0": [0], "2": [2]},
    }


def test_a_late_part_of_an_older_run_is_not_counted(buffer, part):
    start(buffer, "r2", 2, at=200.0)
    part(buffer, "r1", 0, 2, at=201.0, keys=99)  # run r1 was replaced by r2
    part(buffer, "r2", 1, 2, at=200.5, keys=1)
    run = last_run(buffer)
    assert run is not None
    assert (run["keys"], run["parallel"]["reported"]) == (1, 1)


def test_the_dispatchers_own_work_is_part_of_the_run(buffer):
    start(buffer, "r1", 2, at=100.0)
    dispatch = FlushResult(compensated=1, repaired=2)
    buffer.client.hset(
        run_key(buffer), "dispatch:r1", json.dumps({"at": 100.1, "result": dispatch.as_dict()})
    )
    run = last_run(buffer)
    assert run is not None
    assert (run["compensated"], run["repaired"], run["parallel"]["reported"]) == (1, 2, 0)


def test_no_run_recorded(buffer):
    assert last_run(buffer) is None
    assert last_flush(buffer) is None


def test_status_shows_the_newest_of_a_whole_flush_and_a_parallel_run(buffer, part):
    whole = {**FlushResult(keys=9).as_dict(), "at": 150.0}
    buffer.client.hset(
        f"{buffer.prefix}:last_flush", mapping={k: json.dumps(v) for k, v in whole.items()}
    )
    start(buffer, "r1", 2, at=100.0)
    part(buffer, "r1", 0, 2, at=120.0, keys=3)
    shown = last_flush(buffer)
    assert shown is not None
    assert (shown["keys"], shown["parallel"]) == (9, None)
    part(buffer, "r1", 1, 2, at=160.0, keys=4)
    shown = last_flush(buffer)
    assert shown is not None
    assert (shown["keys"], shown["parallel"]["reported"]) == (7, 2)
    assert "at" not in shown and shown["age_seconds"] > 0
