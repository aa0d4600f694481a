"""The gate's margin: how much later than forecast a request's first token comes, at the
quantile the gate must be right at.

A gate that admits whatever is forecast to make its objective admits, under overload, the
requests whose forecast lands just under it, and a forecast is a mean: half of those miss.
The quantile `QUANTILE` of the recent ratios observed / forecast TTFT, applied to every
forecast the gate tests, admits a request only when `QUANTILE` of requests forecast like it
came in time (a split-conformal bound over a sliding window). When the forecasts run long
the margin falls below 1 and the gate admits more; it stays within [`LOW`, `HIGH`].
A forecast shorter than its objective over `HIGH` is observed as that long: no margin
refuses it, and its lateness by an addend (a batch already running on the prefill) held the
margin at its ceiling, refusing the long forecasts it did not describe (docs/SCHEDULING.md).

Only what the gate admits teaches the margin, so a margin left high by a burst of late
answers (a server lost under load) refused, for as long as it stood, every request whose
forecast times it missed: on an idle cluster, a class shed whole never came back, and a
class that kept some traffic waited for a whole window of it. So a ratio counts for
`MAX_AGE` seconds, and with none that recent the margin is 1 again.
"""

from __future__ import annotations

import math
import time

from gateway.slo.window import WindowQuantile

QUANTILE = 0.9  # the share of admitted requests the gate means to see in time
WINDOW = 256  # recent observations the quantile is read from
EVERY = 16  # observations between two reads of the quantile (a sort of WINDOW)
LOW, HIGH = 0.5, 4.0  # the margin's bounds (a few odd requests cannot refuse everything)
WARM = 32  # observations before the margin moves from 1
MAX_AGE = 30.0  # seconds a ratio counts for (time.monotonic())


class Margin:
    """The factor the gate multiplies each forecast TTFT by before it tests the objective."""

    __slots__ = ("value", "_ratios", "_last")

    def __init__(self) -> None:
        self.value = 1.0  # as last read; `factor` is what applies now
        self._ratios = WindowQuantile(QUANTILE, WINDOW, EVERY, WARM, MAX_AGE, default=1.0)
        self._last = -math.inf  # when the last ratio came

    def factor(self, now: float | None = None) -> float:
        """The margin now: 1 once no ratio came for `MAX_AGE` seconds."""
        now = time.monotonic() if now is None else now
        return self.value if now - self._last <= MAX_AGE else 1.0

    def late(self, forecast: float, now: float | None = None) -> float:
        """`forecast` seconds as late as the gate must assume they run."""
        return forecast * self.factor(now)

    def observe(self, observed: float, forecast: float, now: float | None = None, *,
                objective: float | None = None) -> None:
        """One request's first token came `observed` seconds after its pick, forecast at
        `forecast` seconds, against a TTFT `objective` (seconds) when it had one."""
        if observed <= 0 or forecast <= 0:
            return
        if objective is not None:  # the shortest forecast a margin can refuse
            forecast = max(forecast, objective / HIGH)
        now = time.monotonic() if now is None else now
        self.value = self.factor(now)  # 1 if what it held is stale (those ratios leave
        self._last = now  # at the next read)
        read = self._ratios.add(observed / forecast, now)
        if read is not None:
            self.value = min(HIGH, max(LOW, read))
