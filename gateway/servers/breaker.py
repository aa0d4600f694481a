"""Per-server circuit breaker fed by real request outcomes.

closed --(N consecutive failures, or failure rate over a window)--> open
open --(cooldown elapsed; `refresh`)--> half_open: up to `probes` requests at a time
half_open --(success)--> closed;  half_open --(failure)--> open again (cooldown restarts)

State changes only in the methods that say so (`refresh`, `record`, `on_dispatch`,
`release_probe`, `reset`); `admits` and `state` are read without side effects. When no
server of a role admits traffic, the scheduler routes to half-open and open ones anyway
(panic routing, gateway/scheduling/scheduler.py), so a recovering last server is probed by the traffic
itself instead of answering a wall of 503s.
"""

from __future__ import annotations

import time
from collections import deque
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# The members as plain module names: on Python 3.11 `BreakerState.OPEN` is a descriptor
# lookup of about 170 ns, and the request path asks a breaker's state several times.
CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 5,
        cooldown: float = 10.0,
        window: int = 20,
        failure_rate: float = 0.5,
        probes: int = 3,
        clock=time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self.window = window
        self.failure_rate = failure_rate
        self.probes = probes
        self._clock = clock
        self.state = CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.probes_in_flight = 0
        self.opens = 0
        self._recent: deque[bool] = deque(maxlen=window)

    def refresh(self, now: float | None = None) -> None:
        """Move an open breaker whose cooldown elapsed to half-open."""
        if self.state is OPEN:
            now = self._clock() if now is None else now
            if now - self.opened_at >= self.cooldown:
                self.state = HALF_OPEN
                self.probes_in_flight = 0

    @property
    def admits(self) -> bool:
        """May a new request go to this server now (no side effect)?"""
        if self.state is CLOSED:
            return True
        if self.state is OPEN:
            return False
        return self.probes_in_flight < self.probes

    def on_dispatch(self) -> None:
        if self.state is HALF_OPEN:
            self.probes_in_flight += 1

    def release_probe(self) -> None:
        """A half-open probe ended without a verdict (cancelled, or the other leg failed
        first): its place goes to the next request."""
        if self.state is HALF_OPEN and self.probes_in_flight > 0:
            self.probes_in_flight -= 1

    def record(self, success: bool) -> bool:
        """One outcome; True when this failure opened the breaker."""
        self._recent.append(success)
        if success:
            self.consecutive_failures = 0
            if self.state is not CLOSED:
                self.state = CLOSED
                self._recent.clear()
            self.probes_in_flight = 0
            return False
        self.consecutive_failures += 1
        if self.state is HALF_OPEN or self._should_open():
            return self._open()
        return False

    def _should_open(self) -> bool:
        if self.state is OPEN:
            return False
        if self.consecutive_failures >= self.failure_threshold:
            return True
        if len(self._recent) == self.window:
            failures = self._recent.count(False)
            return failures / self.window >= self.failure_rate
        return False

    def _open(self) -> bool:
        opened = self.state is not OPEN
        if opened:
            self.opens += 1
        self.state = OPEN
        self.opened_at = self._clock()
        self.probes_in_flight = 0
        return opened

    def reset(self) -> None:
        self.state = CLOSED
        self.consecutive_failures = 0
        self.probes_in_flight = 0
        self._recent.clear()
