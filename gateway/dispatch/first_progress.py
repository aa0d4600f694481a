"""The deadline of an attempt's first progress: learned, and kept while the attempt is queued.

The learned deadline (gateway/health/deadlines.py) is when the attempt is first looked at,
not when it is cut: a `QueueWatch` (gateway/health/queue_wait.py) then tells a request that
waits its turn on a busy server from one stuck on a silent one, and re-arms the deadline one
learned window later while it is queued, up to the hard limit (`cap`: the response timeout,
the request's own deadline). The attempt's first progress ends the watch (`PDDispatcher.
progress` moves the deadline to the limits that follow).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.cancel import Deadline, Interrupt
from gateway.dispatch.attempt import Attempt
from gateway.health.queue_wait import QueueWatch, shortest_wait
from gateway.timers import Timers


class FirstProgressDeadline(Deadline):
    """A `Deadline` that asks its watch, when due, whether the attempt is only queued."""

    __slots__ = ("watch", "cap")

    def __init__(self, timers: Timers, interrupt: Interrupt, when: float, cap: float,
                 watch: QueueWatch | None) -> None:
        self.watch = watch
        self.cap = cap
        super().__init__(timers, interrupt, min(when, cap))

    def move(self, when: float) -> None:
        """Moved by the attempt's progress: the watch is over."""
        self.watch = None
        super().move(when)

    def queued(self) -> bool:
        return self.watch is not None and self.watch.queued()

    def _expire(self) -> None:
        watch, timers = self.watch, self._timers
        now = timers.loop().time()
        if watch is not None and self.when <= now + timers.resolution \
                and now < self.cap - timers.resolution:
            mono = time.monotonic()
            later = watch.look(mono)
            if later is None:
                self.watch = None
            else:
                self.when = min(self.cap, now + max(later - mono, timers.resolution))
        super()._expire()


def first_deadline(timers: Timers, attempt: Attempt, first: float, response: float,
                   peers: Callable[[], list | None]) -> FirstProgressDeadline:
    """The first-progress deadline of `attempt`, started now, looked at after `first`."""
    prefill = attempt.prefill
    tokens = attempt.prefill_tokens

    def elsewhere() -> float:
        return shortest_wait(peers() or (), prefill, tokens)

    watch = QueueWatch(attempt.prefill_target or prefill, attempt.decode, tokens, first,
                       time.monotonic(), elsewhere)
    started = attempt.started_at
    return FirstProgressDeadline(timers, attempt.interrupt, started + first,
                                 min(started + response, attempt.not_after), watch)
