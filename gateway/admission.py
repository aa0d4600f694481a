"""Admission: a concurrency limit with a bounded, timed wait queue, and API-key checks.

Full queue -> 429 with Retry-After; waited too long -> 503 with Retry-After. Keys are
compared in constant time; inference and admin routes have separate key sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections import deque
from collections.abc import AsyncIterator

from gateway.errors import ServiceUnavailable, TooManyRequests, Unauthorized
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


class KeyChecker:
    """Constant-time API key check against a set of accepted keys (empty: open).

    With `rate` > 0 each key also has a token bucket (`rate` requests/s, `burst` deep): a
    request over it gets 429 with Retry-After. Buckets exist only for configured keys, so
    their number is bounded.
    """

    def __init__(self, keys: tuple[str, ...], rate: float = 0.0, burst: int = 0,
                 metrics: Metrics | None = None, clock=time.monotonic) -> None:
        self._keys = [k.encode() for k in keys]
        self.rate = rate
        self.burst = max(burst, 1)
        self._metrics = metrics
        self._clock = clock
        self._buckets = [[float(self.burst), clock()] for _ in self._keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None, api_key_header: str | None = None) -> None:
        if not self._keys:
            return
        presented = api_key_header
        if authorization and authorization[:7].lower() == "bearer ":
            presented = authorization[7:].strip()
        if not presented:
            raise Unauthorized("missing API key (Authorization: Bearer <key>)")
        candidate = presented.encode()
        found = -1
        for index, key in enumerate(self._keys):  # no early exit: constant time over keys
            if hmac.compare_digest(candidate, key):
                found = index
        if found < 0:
            raise Unauthorized("invalid API key")
        if self.rate > 0:
            self._take(found)

    def _take(self, index: int) -> None:
        bucket = self._buckets[index]
        now = self._clock()
        bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if bucket[0] < 1.0:
            wait = (1.0 - bucket[0]) / self.rate
            if self._metrics is not None:
                self._metrics.rejections.labels("rate_limit").inc()
            raise TooManyRequests(
                f"rate limit of {self.rate:g} requests/s for this API key exceeded",
                headers={"retry-after": str(max(1, round(wait + 0.5)))})
        bucket[0] -= 1.0
