"""counters.repair.clamp on fakeredis: negatives read 0, are warned about once and queued."""

from __future__ import annotations

import logging
from unittest import mock

import fakeredis
import pytest
from redis import RedisError

from counters import repair
from counters.buffer import Buffer
from counters.registry import CounterSpec


@pytest.fixture
def buffer() -> Buffer:
    return Buffer(fakeredis.FakeRedis(server=fakeredis.FakeServer()), "t", shards=2)


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch):
    monkeypatch.setattr(repair, "_warned", set())


@pytest.fixture
def spec() -> CounterSpec:
    return CounterSpec("likes", "auth.User", non_negative=True)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "counters.repair"]


def test_negatives_read_0_and_are_queued(spec, buffer, caplog):
    with caplog.at_level(logging.WARNING, logger="counters.repair"):
        values = repair.clamp(spec, {1: -2, 2: 3, 3: 0}, lambda: buffer)
        again = repair.clamp(spec, {1: -1}, lambda: buffer)
    assert (values, again) == ({1: 0, 2: 3, 3: 0}, {1: 0})
    assert buffer.client.smembers("t:repair") == {b"likes:1"}
    assert warnings(caplog) == [
        "counter likes at 1 reads -2, below zero: showing 0 and queueing it for repair"
    ]


def test_a_counter_that_may_go_negative_is_returned_as_read(buffer):
    spec = CounterSpec("balance", "auth.User")
    values = {1: -5}
    assert repair.clamp(spec, values, lambda: buffer) is values
    assert buffer.client.exists("t:repair") == 0


def test_the_memory_of_warned_keys_is_bounded(spec, buffer, monkeypatch, caplog):
    monkeypatch.setattr(repair, "WARNED_LIMIT", 3)
    with caplog.at_level(logging.WARNING, logger="counters.repair"):
        for key in range(1, 6):
            repair.clamp(spec, {key: -1}, lambda: buffer)
        repair.clamp(spec, {1: -1}, lambda: buffer)  # forgotten when the memory was reset
    assert len(repair._warned) <= 3
    assert len(warnings(caplog)) == 6
    assert buffer.client.scard("t:repair") == 5


def test_many_keys_at_once_log_ten_lines_and_a_count(spec, buffer, caplog):
    with caplog.at_level(logging.WARNING, logger="counters.repair"):
        repair.clamp(spec, {key: -1 for key in range(25)}, lambda: buffer)
    lines = warnings(caplog)
    assert len(lines) == 11
    assert lines[-1] == "... and 15 more keys of likes below zero"


def test_a_redis_failure_while_queueing_still_returns_0(spec, buffer, caplog):
    with (
        mock.patch.object(buffer.client, "sadd", side_effect=RedisError("down")),
        caplog.at_level(logging.WARNING, logger="counters.repair"),
    ):
        assert repair.clamp(spec, {7: -1}, lambda: buffer) == {7: 0}
    assert warnings(caplog)[-1] == "could not queue 1 keys of likes for repair: down"
