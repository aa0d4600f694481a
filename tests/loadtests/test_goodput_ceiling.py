"""The decode ceiling of the goodput benchmark (`loadtests/goodput/ceiling.py`): its
arithmetic written out, that the DES, a placement with perfect information, sustains 0.9x it
and not 1.2x, and that a plan too short for the pools to fill reads past it (why a goal above
the ceiling is out of reach, and why a short window's goodput is a transient's)."""

from __future__ import annotations

import pytest

from loadtests.goodput.capacity import simulate
from loadtests.goodput.ceiling import decode_ceiling, mean_token_steps, token_steps
from loadtests.goodput.physics import Physics
from loadtests.goodput.workload import QUICK_SHAPE, mixed_plan

PHYSICS = Physics(kv_tokens=8192)  # small pools fill in a second of arrivals


@pytest.mark.parametrize(("prompt", "output", "expected"), [
    pytest.param(10, 4, 11 + 12 + 13, id="three-steps-after-the-prefills-token"),
    pytest.param(10, 1, 0, id="the-prefill-gives-the-only-token"),
    pytest.param(0, 3, 1 + 2, id="no-prompt"),
])
def test_a_request_holds_its_context_for_each_decode_step(prompt, output, expected):
    assert token_steps(prompt, output) == expected


def test_the_ceiling_is_the_decodes_least_step_time_per_request():
    """Full steps (the fewest), each paying its fixed part once and every held token and
    request its own part: the profile's coefficients, written out here."""
    plan = mixed_plan(QUICK_SHAPE, 50.0, 120.0, seed=0)
    profile = PHYSICS.profile
    steps = sum(r.max_tokens - 1 for r in plan.requests) / len(plan.requests)
    per_request_ms = (mean_token_steps(plan) * (profile.decode_step_ms / 8192
                                                + profile.decode_ms_per_kv_token)
                      + steps * profile.decode_ms_per_req)
    assert decode_ceiling(QUICK_SHAPE, 50.0, 0, 2, PHYSICS) == pytest.approx(
        2 / (per_request_ms / 1e3))


def _offered(plan) -> float:
    return len(plan.requests) / plan.duration


def test_no_placement_sustains_a_rate_above_the_ceiling_and_the_des_comes_close():
    ceiling = decode_ceiling(QUICK_SHAPE, 100.0, 0, 1, PHYSICS)
    near = mixed_plan(QUICK_SHAPE, 0.9 * ceiling, 30.0, seed=0)
    assert simulate(near, 2, 1, PHYSICS).attainment == 1.0
    above = mixed_plan(QUICK_SHAPE, 1.2 * ceiling, 30.0, seed=0)
    assert _offered(above) > 1.1 * ceiling
    result = simulate(above, 2, 1, PHYSICS)
    assert result.attainment < 0.5, result


def test_a_short_plan_reads_past_the_ceiling_while_the_pools_fill():
    ceiling = decode_ceiling(QUICK_SHAPE, 100.0, 0, 1, PHYSICS)
    short = simulate(mixed_plan(QUICK_SHAPE, ceiling, 10.0, seed=0), 2, 1, PHYSICS)
    long = simulate(mixed_plan(QUICK_SHAPE, ceiling, 30.0, seed=0), 2, 1, PHYSICS)
    assert short.attainment >= 0.9 > long.attainment, (short, long)
