"""Admission: a concurrency limit with a bounded, timed wait queue.

Full queue -> 429 with Retry-After; waited too long -> 503 with Retry-After. (API keys and
their rate limits are checked before, in gateway/auth.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

from gateway.errors import ServiceUnavailable, TooManyRequests
from gateway.metrics import Metrics


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout: float,
                 metrics: Metrics) -> None:
        self.limit = max_concurrency  # 0: unlimited
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.metrics = metrics
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the `limit` slots; a finishing request hands its slot to the first
        waiter directly, so nobody can overtake the queue."""
        if self.limit and (self.active >= self.limit or self._waiters):
            await self._wait()
        else:
            self.active += 1
        try:
            yield
        finally:
            self._release()

    async def _wait(self) -> None:
        if len(self._waiters) >= self.max_queue:
            self.metrics.rejections.labels("queue_full").inc()
            raise TooManyRequests("gateway is at capacity and its queue is full; retry later",
                                  headers={"retry-after": "1"})
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.queue_timeout):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # granted at the last moment: pass the slot on
            self.metrics.rejections.labels("queue_timeout").inc()
            raise ServiceUnavailable(
                f"no capacity within {self.queue_timeout:g}s; retry later",
                headers={"retry-after": "2"}) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release()
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self.metrics.queue_time.observe(time.perf_counter() - started)

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; `active` unchanged
                return
        self.active -= 1
