"""Per-server circuit breaker fed by real request outcomes.

closed --(N consecutive failures, or failure rate over a window)--> open
open --(cooldown elapsed)--> half_open: one probe request at a time is let through
half_open --(success)--> closed;  half_open --(failure)--> open again (cooldown restarts)
"""

from __future__ import annotations

import time
from collections import deque
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 5,
        cooldown: float = 10.0,
        window: int = 20,
        failure_rate: float = 0.5,
        clock=time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self.window = window
        self.failure_rate = failure_rate
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.probe_in_flight = False
        self.opens = 0
        self._recent: deque[bool] = deque(maxlen=window)

    def allows(self) -> bool:
        """May a new request go to this server now?"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if self._clock() - self.opened_at >= self.cooldown:
                self.state = BreakerState.HALF_OPEN
                self.probe_in_flight = False
            else:
                return False
        return not self.probe_in_flight

    def peek(self) -> bool:
        """What `allows()` would answer, without moving an open breaker to half-open."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return self._clock() - self.opened_at >= self.cooldown
        return not self.probe_in_flight

    def on_dispatch(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = True

    def release_probe(self) -> None:
        """The half-open probe ended without a verdict (cancelled, or the other leg failed
        first): let the next request probe instead of refusing traffic for good."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = False

    def record(self, success: bool) -> None:
        self._recent.append(success)
        if success:
            self.consecutive_failures = 0
            if self.state is not BreakerState.CLOSED:
                self.state = BreakerState.CLOSED
                self._recent.clear()
            self.probe_in_flight = False
            return
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or self._should_open():
            self._open()

    def _should_open(self) -> bool:
        if self.consecutive_failures >= self.failure_threshold:
            return True
        if len(self._recent) == self.window:
            failures = self._recent.count(False)
            return failures / self.window >= self.failure_rate
        return False

    def _open(self) -> None:
        if self.state is not BreakerState.OPEN:
            self.opens += 1
        self.state = BreakerState.OPEN
        self.opened_at = self._clock()
        self.probe_in_flight = False

    def reset(self) -> None:
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.probe_in_flight = False
        self._recent.clear()
