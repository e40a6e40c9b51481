"""Reads asked for by many coroutines of one event loop, made together.

``Batched(fetch)`` answers ``await batched.get(key)`` by calls of
``fetch(keys) -> {key: value}`` in a thread of the event loop's shared pool,
one call at a time per loop: a call answers every coroutine that asked before it
started (those woken together ask in the same turn of the loop; those that ask
while it runs, by the next call). A coroutine's own thread, and the database
connection of its request, are never held. A call that raises raises in every
coroutine it was answering.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from asgiref.sync import sync_to_async

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Batched(Generic[K, V]):
    """The reads of ``fetch``, batched per event loop (see the module)."""

    def __init__(self, fetch: Callable[[list[K]], dict[K, V]]) -> None:
        self.fetch = fetch
        #: loop -> the keys asked for and not answered yet, with their callers' futures.
        self._waiting: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[K, list[asyncio.Future[V]]]
        ] = weakref.WeakKeyDictionary()
        #: loop -> the task making its calls, while there is one.
        self._running: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[None]] = (
            weakref.WeakKeyDictionary()
        )

    async def get(self, key: K) -> V:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[V] = loop.create_future()
        self._waiting.setdefault(loop, {}).setdefault(key, []).append(future)
        if loop not in self._running:
            self._running[loop] = loop.create_task(self._run(loop))
        return await future

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            await asyncio.sleep(0)  # the others woken with the first caller ask first
            while waiting := self._waiting.pop(loop, None):
                await self._answer(waiting)
        finally:
            del self._running[loop]

    async def _answer(self, waiting: dict[K, list[asyncio.Future[V]]]) -> None:
        try:
            values = await sync_to_async(self.fetch, thread_sensitive=False)(list(waiting))
        except Exception as exc:
            for futures in waiting.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            return
        for key, futures in waiting.items():
            for future in futures:
                if not future.done():
                    future.set_result(values[key])
