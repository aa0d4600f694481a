"""Prefill answers that trail a finished decode, each given a bounded time to arrive.

SGLang's prefill server often answers after its decode (seen on the CPU rig): the client has
its answer, but the prefill leg's task still reads the prefill's own answer (its prompt and
cached tokens, the leg's outcome for the breaker). That task is kept here, and cancelled,
with an abort sent to the server, if it has not ended `timeout` seconds after the decode.

This happens on a large share of successful requests, so a tail costs one dict entry, not a
timer and a done-callback of its own: the prefill task's existing done-callback (pd's
`_PrefillWatch`) takes the entry back, and since every tail waits the same `timeout`, the
entries expire in the order they came, swept by one timer armed for the oldest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.timers import Timer, Timers


class PrefillTails:
    def __init__(self, timers: Timers, timeout: float,
                 expired: Callable[[object, asyncio.Task], None]) -> None:
        self.timers = timers
        self.timeout = timeout
        self.expired = expired  # (attempt, task): the tail's time is up (cancel, abort)
        self._waiting: dict[asyncio.Task, tuple[float, object]] = {}  # oldest first
        self._sweep: Timer | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, attempt: object, task: asyncio.Task) -> None:
        """`task` (the attempt's prefill leg) may run `timeout` seconds more; it is held here
        until it ends (the loop keeps only a weak reference to a task)."""
        when = self.timers.loop().time() + self.timeout
        self._waiting[task] = (when, attempt)
        if self._sweep is None:
            self._sweep = self.timers.at(when, self._expire)

    def ended(self, task: asyncio.Task) -> None:
        """The prefill task ended (its done-callback): nothing to wait for any more."""
        if self._waiting:
            self._waiting.pop(task, None)

    def cancel_all(self) -> list[asyncio.Task]:
        """At shutdown: stop the sweep; the tasks still running, for the caller to cancel."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        tasks = list(self._waiting)
        self._waiting.clear()
        return tasks

    def _expire(self) -> None:
        self._sweep = None
        waiting = self._waiting
        now = self.timers.loop().time() + self.timers.resolution
        while waiting:
            task, (when, attempt) = next(iter(waiting.items()))
            if when > now:
                self._sweep = self.timers.at(when, self._expire)
                return
            del waiting[task]
            if not task.done():
                self.expired(attempt, task)
