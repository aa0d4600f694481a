"""Capped exponential backoff with jitter, for retrying the Kubernetes API.

Each delay is drawn from [d/2, d] where d starts at `initial` and doubles up to `maximum`,
so many gateway replicas that lost the API server at once do not come back in step.
"""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    def __init__(self, initial: float = 0.5, maximum: float = 30.0,
                 rng: Callable[[], float] = random.random) -> None:
        if not 0 < initial <= maximum:
            raise ValueError("backoff needs 0 < initial <= maximum")
        self.initial = initial
        self.maximum = maximum
        self._rng = rng
        self._ceiling = initial

    def next(self) -> float:
        """The delay before the next attempt; later calls wait longer, up to the cap."""
        ceiling = self._ceiling
        self._ceiling = min(self.maximum, ceiling * 2)
        return ceiling / 2 + self._rng() * ceiling / 2

    def reset(self) -> None:
        """After a success: the next failure starts again from the initial delay."""
        self._ceiling = self.initial
