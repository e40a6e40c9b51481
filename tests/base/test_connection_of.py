"""``connection_of(alias)`` is ``connections[alias]`` wherever the caller runs."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.db import connections

from counters.base.utils import connection_of


def test_a_sync_thread_gets_its_own_connection_object():
    assert connection_of("default") is connections["default"]
    seen: dict[str, object] = {}

    def other() -> None:
        seen["first"] = connection_of("default")  # not made yet in this thread
        seen["handler"] = connections["default"]
        seen["again"] = connection_of("default")
        connections["default"].close()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen["first"] is seen["handler"] is seen["again"]
    assert seen["first"] is not connections["default"]  # each thread has its own


def test_inside_a_running_event_loop_it_is_the_handlers_lookup():
    async def lookup() -> tuple[object, object]:
        return connection_of("default"), connections["default"]

    mine, handlers = asyncio.run(lookup())
    assert mine is handlers


def test_an_unknown_alias_raises_as_the_handler_does():
    from django.utils.connection import ConnectionDoesNotExist

    with pytest.raises(ConnectionDoesNotExist):
        connection_of("nowhere")
