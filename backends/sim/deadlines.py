"""Timeouts of one fixed length, sharing a single loop timer.

Every PD leg arms a timeout (the prefill's --bootstrap-timeout, the decode's
--waiting-timeout) that almost never fires. Arming and cancelling a uvloop
timer costs ~5 us, a noticeable share of a PD pair's budget. All deadlines
of one queue have the same length, so they expire in the order they were
added: a deque and one timer for its head are enough, and a cancelled entry
costs a flag. Cancelled entries at the head are dropped as new ones arrive,
so the deque stays as long as the number of legs actually waiting.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class Deadline:
    """One armed timeout; `expired` tells a woken waiter why it woke."""

    __slots__ = ("at", "callback", "expired")

    def __init__(self, at: float, callback: Callable[[], None] | None) -> None:
        self.at = at
        self.callback = callback
        self.expired = False

    def cancel(self) -> None:
        self.callback = None


class DeadlineQueue:
    """Deadlines `seconds` after `add()`, fired in order by one timer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._entries: deque[Deadline] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, callback: Callable[[], None]) -> Deadline:
        """Call `callback` (after setting `expired`) unless cancelled in time."""
        loop = asyncio.get_running_loop()
        entries = self._entries
        while entries and entries[0].callback is None:
            entries.popleft()
        entry = Deadline(loop.time() + self.seconds, callback)
        entries.append(entry)
        if self._timer is None:
            self._timer = loop.call_at(entries[0].at, self._fire)
        return entry

    def _fire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        entries = self._entries
        while entries:
            head = entries[0]
            if head.callback is not None and head.at > now:
                self._timer = loop.call_at(head.at, self._fire)
                return
            entries.popleft()
            callback, head.callback = head.callback, None
            if callback is not None:
                head.expired = True
                callback()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._entries.clear()
