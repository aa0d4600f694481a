"""The gate's margin: how much later than forecast a request's first token comes, at the
quantile the gate must be right at.

A gate that admits whatever is forecast to make its objective admits, under overload, the
requests whose forecast lands just under it, and a forecast is a mean: half of those miss.
The quantile `QUANTILE` of the recent ratios observed / forecast TTFT, applied to every
forecast the gate tests, admits a request only when `QUANTILE` of requests forecast like it
came in time (a split-conformal bound over a sliding window). When the forecasts run long
the margin falls below 1 and the gate admits more; it stays within [`LOW`, `HIGH`].
"""

from __future__ import annotations

from gateway.slo.window import WindowQuantile

QUANTILE = 0.9  # the share of admitted requests the gate means to see in time
WINDOW = 256  # recent observations the quantile is read from
EVERY = 16  # observations between two reads of the quantile (a sort of WINDOW)
LOW, HIGH = 0.5, 4.0  # the margin's bounds (a few odd requests cannot refuse everything)
WARM = 32  # observations before the margin moves from 1


class Margin:
    """The factor the gate multiplies each forecast TTFT by before it tests the objective."""

    __slots__ = ("value", "_ratios")

    def __init__(self) -> None:
        self.value = 1.0
        self._ratios = WindowQuantile(QUANTILE, WINDOW, EVERY, WARM)

    def late(self, forecast: float) -> float:
        """`forecast` seconds as late as the gate must assume they run."""
        return forecast * self.value

    def observe(self, observed: float, forecast: float) -> None:
        """One request's first token came `observed` seconds after its pick, forecast at
        `forecast` seconds."""
        if observed <= 0 or forecast <= 0:
            return
        read = self._ratios.add(observed / forecast)
        if read is not None:
            self.value = min(HIGH, max(LOW, read))
