"""A quantile of the recent observations, read every few: what the gate's margin and its
queue bound both keep (slo/margin.py, slo/tolerance.py)."""

from __future__ import annotations

import math
from collections import deque


class WindowQuantile:
    """The `quantile` of the last `window` values seen within `max_age` seconds, read again
    every `every` values (a sort of the window per read, not per value); `default` while
    fewer than `warm` are there."""

    __slots__ = ("quantile", "every", "warm", "max_age", "default", "_values", "_since")

    def __init__(self, quantile: float, window: int, every: int, warm: int,
                 max_age: float = math.inf, default: float | None = None) -> None:
        self.quantile, self.every, self.warm = quantile, every, warm
        self.max_age, self.default = max_age, default
        self._values: deque[tuple[float, float]] = deque(maxlen=window)  # (when, value)
        self._since = 0  # values since the last read

    def add(self, value: float, now: float = 0.0) -> float | None:
        """Keep `value` (seen at `now`); the quantile when this value is a read's turn
        (`default` if too few are recent), else None."""
        values = self._values
        values.append((now, value))
        self._since += 1
        if self._since < self.every:
            return None
        self._since = 0
        oldest = now - self.max_age
        while values and values[0][0] < oldest:
            values.popleft()
        if len(values) < self.warm:
            return self.default
        ordered = sorted(v for _, v in values)
        return ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)]
