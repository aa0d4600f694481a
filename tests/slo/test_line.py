"""The fleet's TTFT line (gateway/slo/line.py): a fixed part the factor alone would scale."""

from __future__ import annotations

import pytest

from gateway.slo.line import MIN_SAMPLES, LineFit
from gateway.slo.model import LatencyModel
from tests.unit.builders import server


def test_the_line_through_noiseless_samples() -> None:
    fit = LineFit()
    for i in range(40):
        raw = (0.01, 0.5, 0.2)[i % 3]
        fit.add(raw, 0.25 + 0.4 * raw)
    offset, slope = fit.fitted
    assert offset == pytest.approx(0.25, rel=1e-6) and slope == pytest.approx(0.4, rel=1e-6)


@pytest.mark.parametrize("samples, why", [
    ([(0.1, 0.3)] * 20, "forecasts that do not vary give no slope"),
    ([(0.1, 0.3), (0.5, 0.7)] * (MIN_SAMPLES // 2 - 1), "too few samples"),
    ([(0.1, 0.01), (0.5, 0.9)] * 10, "a negative fixed time"),
    ([(0.1, 0.9), (0.5, 0.1)] * 10, "TTFT falling as the forecast grows"),
])
def test_no_line_until_the_samples_determine_one(samples, why) -> None:
    fit = LineFit()
    for raw, observed in samples:
        fit.add(raw, observed)
    assert fit.fitted is None, why


def test_short_and_long_prompts_both_forecast_when_time_has_a_fixed_part() -> None:
    """Alternating 50- and 2,000-token prompts on servers whose TTFT is 0.25 s plus 0.4x the
    physics: each forecast lands within 10% (a factor alone: the short ones at about 3x
    their forecast, the long ones at about half)."""
    model = LatencyModel()
    p, d = server("p", load={"prefill_speed": 20_000.0}, age=1.0), server("d", "decode")
    sizes = (50, 2000)
    for i in range(60):
        guess = model.predict(p, d, sizes[i % 2], 0)
        model.observe("p", "d", guess, 0.25 + 0.4 * guess.raw_ttft, None)
    for size in sizes:
        guess = model.predict(p, d, size, 0)
        assert guess.ttft == pytest.approx(0.25 + 0.4 * guess.raw_ttft, rel=0.1), size
    offset, slope = model.factors()["line"]
    assert offset == pytest.approx(0.25, rel=0.05) and slope == pytest.approx(0.4, rel=0.05)
