"""The fleet's TTFT as a line of the physics forecast: observed = offset + slope x raw.

Why a line and not only a factor: part of a request's time does not grow with its prompt
(the gateway's own path, HTTP and tokenization, the server's scheduling and the bootstrap
handshake). A factor alone scales that fixed part with the forecast: it learns a mean of
observed / raw, so short prompts come out under their TTFT and long ones over it, and the
median error of a mix of both lands anywhere between the two (on the CPU rig: 0.05-1.0 s
observed against 0.01-0.8 s raw, tests/e2e_sglang/test_slo.py). The line is fitted by least
squares over exponentially weighted moments (recent requests weigh more, as the factors'
do), and used only once it is determined: enough samples, forecasts that vary enough to
give a slope, a positive slope within the factors' clamp and no negative fixed time; until
then the fleet's factor stands (gateway/slo/model.py).
"""

from __future__ import annotations

MIN_SAMPLES = 8  # requests seen before a line is trusted
WEIGHT = 0.05  # a new sample's weight once past 1 / WEIGHT samples (a plain mean before)
SPREAD = 0.25  # forecasts must vary by this share of their mean (coefficient of variation)
SLOPE_MIN, SLOPE_MAX = 1 / 8, 8.0  # as the factors' clamp (model.CLAMP)


class LineFit:
    """Weighted moments of (raw forecast, observed) pairs, and the line through them."""

    __slots__ = ("n", "mx", "my", "mxx", "mxy", "fitted")

    def __init__(self) -> None:
        self.n = 0
        self.mx = self.my = self.mxx = self.mxy = 0.0
        self.fitted: tuple[float, float] | None = None  # `line()` as of the last sample

    def add(self, raw: float, observed: float) -> None:
        self.n += 1
        w = max(WEIGHT, 1.0 / self.n)
        self.mx += w * (raw - self.mx)
        self.my += w * (observed - self.my)
        self.mxx += w * (raw * raw - self.mxx)
        self.mxy += w * (raw * observed - self.mxy)
        self.fitted = self.line()  # once per sample, not on every forecast

    def line(self) -> tuple[float, float] | None:
        """(offset seconds, slope), or None while the samples do not determine one."""
        if self.n < MIN_SAMPLES:
            return None
        var = self.mxx - self.mx * self.mx
        if var <= (SPREAD * self.mx) ** 2:
            return None
        slope = (self.mxy - self.mx * self.my) / var
        if not SLOPE_MIN <= slope <= SLOPE_MAX:
            return None
        offset = self.my - slope * self.mx
        return (offset, slope) if offset >= 0.0 else None
