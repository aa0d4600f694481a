"""Deadlines that are almost always cancelled, at a fraction of the cost of a loop timer.

Every request arms several deadlines (its head and body on the connection, the keep-alive
wait after it, the attempt's first-progress deadline, the request's own timeout) and nearly
all of them are cancelled long before they expire. A uvloop `call_at` costs a libuv timer
per handle (create, start, stop, close: 2-3 us each here, several per request, about a tenth
of the gateway's CPU per request, measured in docs/BENCHMARKS.md "Cost per request").

`Timers` keeps deadlines in buckets of `resolution` seconds (a dict of dicts, so a cancel is
one dict deletion) and runs one loop timer for the earliest bucket that still holds one. A
deadline fires at most `resolution` late, never early. Callbacks run from the loop, outside
any task, like `call_at` callbacks.

One `Timers` per event loop; the gateway makes it and hands it to whatever arms deadlines
per request.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable

RESOLUTION = 0.01  # seconds


class Timer:
    """One armed deadline; `cancel()` takes it back (idempotent)."""

    __slots__ = ("when", "_callback", "_args", "_owner", "_bucket")

    def __init__(self, owner: Timers, bucket: int, when: float, callback: Callable,
                 args: tuple) -> None:
        self.when = when
        self._callback = callback
        self._args = args
        self._owner = owner
        self._bucket = bucket

    @property
    def active(self) -> bool:
        return self._callback is not None

    def cancel(self) -> None:
        if self._callback is not None:
            self._callback = self._args = None
            self._owner._forget(self)

    def _run(self) -> None:
        callback, args = self._callback, self._args
        self._callback = self._args = None
        callback(*args)


class Timers:
    def __init__(self, resolution: float = RESOLUTION) -> None:
        self.resolution = resolution
        self._buckets: dict[int, dict[Timer, None]] = {}
        self._due: list[int] = []  # heap of bucket numbers (may hold emptied ones)
        self._armed: int | None = None  # the bucket the loop timer is set for
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def at(self, when: float, callback: Callable, *args) -> Timer:
        """Run `callback(*args)` at loop time `when` (up to `resolution` later)."""
        bucket = math.ceil(when / self.resolution)
        timer = Timer(self, bucket, when, callback, args)
        timers = self._buckets.get(bucket)
        if timers is None:
            timers = self._buckets[bucket] = {}
            heapq.heappush(self._due, bucket)
            if self._armed is None or bucket < self._armed:
                self._arm(bucket)
        timers[timer] = None
        return timer

    def after(self, delay: float, callback: Callable, *args) -> Timer:
        return self.at(self.loop().time() + delay, callback, *args)

    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def close(self) -> None:
        """Drop every deadline (at shutdown)."""
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._armed = None
        self._buckets.clear()
        self._due.clear()

    # -- internals -------------------------------------------------------------------------
    def _forget(self, timer: Timer) -> None:
        timers = self._buckets.get(timer._bucket)
        if timers is not None:
            timers.pop(timer, None)
            if not timers:
                del self._buckets[timer._bucket]  # its heap entry is skipped when due

    def _arm(self, bucket: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = bucket
        self._handle = self.loop().call_at(bucket * self.resolution, self._tick)

    def _tick(self) -> None:
        self._handle = self._armed = None
        now = self.loop().time()
        due = self._due
        while due and due[0] * self.resolution <= now + 0.001:  # uvloop: a 1 ms clock
            timers = self._buckets.pop(heapq.heappop(due), None)
            if timers:
                for timer in list(timers):
                    if timer._callback is not None:
                        timer._run()
        while due and due[0] not in self._buckets:  # emptied by cancels
            heapq.heappop(due)
        if due and self._armed is None:
            self._arm(due[0])
