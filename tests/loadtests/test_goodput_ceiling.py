"""The decode ceiling of the goodput benchmark (`loadtests/goodput/ceiling.py`): its
arithmetic by hand, and that the DES, a placement with perfect information, cannot sustain a
rate above it, while a plan too short for the pools to fill can read past it (why a goal above
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


def test_the_ceiling_is_the_pools_over_the_mixs_token_seconds_at_the_shortest_step():
    plan = mixed_plan(QUICK_SHAPE, 50.0, 120.0, seed=0)
    shortest = PHYSICS.profile.decode_ms(1, 0) / 1e3
    expected = 2 * 8192 / (mean_token_steps(plan) * shortest)
    assert decode_ceiling(QUICK_SHAPE, 50.0, 0, 2, PHYSICS) == pytest.approx(expected)
    # twice the pools, twice the ceiling: nothing else in it depends on the cluster
    assert decode_ceiling(QUICK_SHAPE, 50.0, 0, 2, Physics(kv_tokens=16384)) == pytest.approx(
        2 * expected)


def test_no_placement_sustains_a_rate_above_the_ceiling():
    ceiling = decode_ceiling(QUICK_SHAPE, 100.0, 0, 1, PHYSICS)
    below = simulate(mixed_plan(QUICK_SHAPE, 0.5 * ceiling, 30.0, seed=0), 2, 1, PHYSICS)
    assert below.attainment == 1.0
    above = simulate(mixed_plan(QUICK_SHAPE, 1.1 * ceiling, 30.0, seed=0), 2, 1, PHYSICS)
    assert above.attainment < 0.5, above


def test_a_short_plan_reads_past_the_ceiling_while_the_pools_fill():
    ceiling = decode_ceiling(QUICK_SHAPE, 100.0, 0, 1, PHYSICS)
    short = simulate(mixed_plan(QUICK_SHAPE, ceiling, 10.0, seed=0), 2, 1, PHYSICS)
    long = simulate(mixed_plan(QUICK_SHAPE, ceiling, 30.0, seed=0), 2, 1, PHYSICS)
    assert short.attainment >= 0.9 > long.attainment, (short, long)
