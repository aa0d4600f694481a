"""Answers computed at most once per time-to-live, shared by every caller (single flight).

Endpoints that make the servers work (`/health_generate` runs a real generation, `/server_info`
asks every server) are open to probes or to every inference caller; through this cache a flood
of callers costs the servers one computation per `ttl` seconds, and concurrent callers wait for
the one computation in progress instead of starting their own. `/metrics` (open to scrapers,
rendered on the event loop) is kept the same way, for 20 times its rendering, at most 0.25 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class TtlCache(Generic[T]):
    """One answer, kept `ttl` seconds; with `cost_ratio`, kept `cost_ratio` times as long as
    its computation took, at most `ttl` (a computation on the event loop then takes at most
    1 / (1 + cost_ratio) of it however often it is asked for, and a cheap one stays fresh)."""

    def __init__(self, ttl: float, compute: Callable[[], Awaitable[T]],
                 clock: Callable[[], float] = time.monotonic,
                 cost_ratio: float | None = None) -> None:
        self.ttl = ttl
        self.compute = compute
        self.clock = clock
        self.cost_ratio = cost_ratio
        self.computations = 0
        self._value: T | None = None
        self._at = float("-inf")
        self._kept = ttl  # seconds the current answer is kept
        self._pending: asyncio.Task | None = None

    async def get(self) -> T:
        if self._value is not None and self.clock() - self._at < self._kept:
            return self._value
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_task(self._refresh())
        # shield: a caller that goes away must not cancel the others' computation
        return await asyncio.shield(self._pending)

    async def _refresh(self) -> T:
        try:
            self.computations += 1
            started = self.clock()
            value = await self.compute()
            self._value, self._at = value, self.clock()
            if self.cost_ratio is not None:
                self._kept = min(self.ttl, self.cost_ratio * (self._at - started))
            return value
        finally:
            self._pending = None

    async def close(self) -> None:
        task = self._pending
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


Answer = tuple[int, bytes]  # (status, JSON body) of a cached endpoint


class InfoCaches:
    """The cache of each endpoint's answer, by name: made on its first use (with the
    computation given then, and its own `ttl` and `cost_ratio` if given: /metrics keeps a page
    for at most 0.25 s, not for `--info-cache-ttl`), closed when the gateway stops."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self._caches: dict[str, TtlCache[Answer]] = {}

    def get(self, name: str, compute: Callable[[], Awaitable[Answer]],
            ttl: float | None = None, cost_ratio: float | None = None) -> TtlCache[Answer]:
        cache = self._caches.get(name)
        if cache is None:
            cache = self._caches[name] = TtlCache(self.ttl if ttl is None else ttl, compute,
                                                  self.clock, cost_ratio)
        return cache

    async def close(self) -> None:
        for cache in self._caches.values():
            await cache.close()
