"""Single flight: concurrent askers for the same key share one task (one token request for a
burst of requests), and a waiter that is cancelled does not cancel it for the others."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Flights(Generic[K, V]):
    def __init__(self) -> None:
        self._inflight: dict[K, asyncio.Task[V]] = {}

    async def run(self, key: K, start: Callable[[], Awaitable[V]], name: str) -> V:
        task = self._inflight.get(key)
        if task is None:
            async def go() -> V:
                return await start()

            task = asyncio.create_task(go(), name=name)
            self._inflight[key] = task

            def done(t: asyncio.Task[V], k: K = key) -> None:
                if self._inflight.get(k) is t:
                    del self._inflight[k]
                if not t.cancelled():
                    t.exception()  # retrieved even if every waiter was cancelled

            task.add_done_callback(done)
        return await asyncio.shield(task)
