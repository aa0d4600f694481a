"""A quantile of the recent observations, read every few: what the gate's margin and its
queue bound both keep (slo/margin.py, slo/tolerance.py)."""

from __future__ import annotations

import math
from collections import deque


class WindowQuantile:
    """The `quantile` of the last `window` values, read again every `every` values once
    `warm` are seen (a sort of the window per read, not per value)."""

    __slots__ = ("quantile", "every", "warm", "_values", "_since")

    def __init__(self, quantile: float, window: int, every: int, warm: int) -> None:
        self.quantile, self.every, self.warm = quantile, every, warm
        self._values: deque[float] = deque(maxlen=window)
        self._since = 0  # values since the last read

    def add(self, value: float) -> float | None:
        """Keep `value`; the quantile when this value is a read's turn, else None."""
        self._values.append(value)
        self._since += 1
        if self._since < self.every or len(self._values) < self.warm:
            return None
        self._since = 0
        ordered = sorted(self._values)
        return ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)]
