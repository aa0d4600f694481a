"""Admission: a concurrency limit with a bounded, timed wait queue.

Full queue -> 429 with Retry-After; waited too long -> 503 with Retry-After. (API keys and
their rate limits are checked before, in gateway/auth.py.)

With `--workers N` the limit holds for the gateway as a whole: slots are taken in shared
memory (gateway/shared_state.py), each worker queues its own waiters, and a waiter gets a slot
freed by any worker (a local release hands it on at once; slots freed elsewhere are noticed
within `POLL` seconds).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from gateway.errors import ServiceUnavailable, TooManyRequests
from gateway.metrics import Metrics

POLL = 0.005  # seconds between looks at slots other workers freed


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout: float,
                 metrics: Metrics, shared=None) -> None:
        self.limit = max_concurrency  # 0: unlimited
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.metrics = metrics
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.shared = shared  # (SharedState, worker id) with --workers
        self._poller: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def slot(self) -> Admission:
        """`async with admission.slot():` holds one of the `limit` slots; a finishing request
        hands its slot to the first waiter directly, so nobody can overtake the queue. (The
        slot carries no state of its own, so the admission is its own context manager: no
        generator per request.)"""
        return self

    async def __aenter__(self) -> None:
        if self.limit and not self._take():
            await self._wait()
        else:
            self.active += 1

    async def __aexit__(self, *exc_info) -> None:
        self._release()

    async def _wait(self) -> None:
        if len(self._waiters) >= self.max_queue:
            self.metrics.rejections.labels("queue_full").inc()
            raise TooManyRequests("gateway is at capacity and its queue is full; retry later",
                                  headers={"retry-after": "1"})
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._watch_others()
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

    def _take(self) -> bool:
        """A free slot for a new request (never ahead of this worker's waiters)."""
        if self._waiters:
            return False
        if self.shared is None:
            return self.active < self.limit
        state, worker = self.shared
        return state.try_admit(worker, self.limit)

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; `active` unchanged
                return
        self.active -= 1
        if self.shared is not None and self.limit:
            state, worker = self.shared
            state.release(worker)

    def _watch_others(self) -> None:
        """With workers: while waiters queue here, look for slots freed in other workers."""
        if self.shared is not None and (self._poller is None or self._poller.done()):
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        state, worker = self.shared
        while self._waiters:
            await asyncio.sleep(POLL)
            while self._waiters and state.try_admit(worker, self.limit):
                waiter = self._waiters.popleft()
                if waiter.done():
                    state.release(worker)
                    continue
                self.active += 1
                waiter.set_result(None)
