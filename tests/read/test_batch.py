"""The batched reads of watchers and streams: one call answers every caller that asked before it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from counters.read.batch import Batched


def test_callers_of_one_turn_share_one_call_and_those_during_it_the_next():
    calls: list[list[int]] = []
    started, release = threading.Event(), threading.Event()

    def fetch(keys: list[int]) -> dict[int, int]:
        calls.append(sorted(keys))
        if len(calls) == 1:
            started.set()
            release.wait(5)
        return {k: k * 10 for k in keys}

    batched: Batched[int, int] = Batched(fetch)

    async def scenario() -> list[int]:
        first = [asyncio.ensure_future(batched.get(k)) for k in (1, 2, 2, 3)]
        await asyncio.to_thread(started.wait, 5)
        later = [asyncio.ensure_future(batched.get(k)) for k in (3, 4)]
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(*first, *later)

    assert asyncio.run(scenario()) == [10, 20, 20, 30, 30, 40]
    assert calls == [[1, 2, 3], [3, 4]]


def test_a_failed_call_raises_in_every_caller_it_answered_and_the_next_call_runs():
    calls = 0

    def fetch(keys: list[str]) -> dict[str, str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("database down")
        return {k: k.upper() for k in keys}

    batched: Batched[str, str] = Batched(fetch)

    async def scenario() -> None:
        results = await asyncio.gather(batched.get("a"), batched.get("b"), return_exceptions=True)
        assert [str(r) for r in results] == ["database down", "database down"]
        assert await batched.get("c") == "C"

    asyncio.run(scenario())
    assert calls == 2


def test_each_event_loop_has_its_own_calls():
    seen: list[list[int]] = []

    def fetch(keys: list[int]) -> dict[int, int]:
        seen.append(keys)
        return {k: -k for k in keys}

    batched: Batched[int, int] = Batched(fetch)
    for _ in range(2):
        assert asyncio.run(batched.get(7)) == -7
    assert seen == [[7], [7]]


@pytest.mark.parametrize("callers", [1, 50])
def test_every_caller_gets_its_own_keys_value(callers):
    batched: Batched[int, int] = Batched(lambda keys: {k: k + 1 for k in keys})

    async def scenario() -> list[int]:
        return await asyncio.gather(*(batched.get(i) for i in range(callers)))

    assert asyncio.run(scenario()) == [i + 1 for i in range(callers)]
