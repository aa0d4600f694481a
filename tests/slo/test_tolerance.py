"""The queueing the tightest objectives bear (gateway/slo/tolerance.py), and the gate that keeps
long objectives from crowding out short ones while requests wait in it."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from gateway.slo.tolerance import QUANTILE, WARM, Tolerance
from tests.slo.test_gate import BATCH, INTERACTIVE, STANDARD, Forecasts, gate, prediction, request

LOOSE = [(b"x-slo-ttft-ms", b"3000")]  # a long document's objective, against the classes' 1 s


def test_the_bound_is_the_low_quantile_of_a_class_and_of_the_more_urgent_ones() -> None:
    rng = random.Random(3)
    tolerance = Tolerance(3)
    batch = [rng.uniform(0.2, 0.6) for _ in range(64)]
    interactive = [rng.uniform(1.0, 3.0) for _ in range(64)]
    for value in batch[:WARM - 1]:
        tolerance.observe(BATCH, value)
    assert tolerance.bound(BATCH) == math.inf  # too few to say
    for value in batch[WARM - 1:]:
        tolerance.observe(BATCH, value)
    for value in interactive:
        tolerance.observe(INTERACTIVE, value)
    low = sorted(interactive)[math.ceil(QUANTILE * len(interactive)) - 1]
    assert tolerance.bound(INTERACTIVE) == pytest.approx(low)
    # a batch request bears what interactive ones do; batch never bounds interactive
    assert tolerance.bound(BATCH) == pytest.approx(sorted(batch)[math.ceil(QUANTILE * 64) - 1])
    assert tolerance.bound(BATCH) < tolerance.bound(STANDARD) == tolerance.bound(INTERACTIVE)


def _warmed(forecasts: Forecasts):
    """A gate that has seen WARM interactive requests bearing 0.9 s of queueing each (1 s
    objective, 0.1 s of their own work), all of which it sent."""
    slo, metrics = gate(forecasts)

    async def warm() -> None:
        for i in range(WARM):
            await slo.admit(request(slo, INTERACTIVE, rid=f"warm{i}"))

    asyncio.run(warm())
    assert slo.tolerance.bound(INTERACTIVE) == pytest.approx(0.9)
    return slo, metrics


def test_with_nobody_waiting_a_long_objective_may_queue_as_long_as_it_bears() -> None:
    forecasts = Forecasts(0.5)
    slo, _ = _warmed(forecasts)
    forecasts.next = prediction(1.3)  # 1.2 s queued: past what the 1 s requests bear
    asyncio.run(asyncio.wait_for(slo.admit(request(slo, INTERACTIVE, LOOSE, "loose")), 0.04))


def test_while_a_short_objective_waits_a_long_one_does_not_fill_the_queue_past_it() -> None:
    """Past capacity the queues stay at what the tightest requests bear: a 3 s request that
    its own objective would let through waits behind a waiting 1 s one, and both go once the
    queue is short again."""
    forecasts = Forecasts(0.5)
    slo, metrics = _warmed(forecasts)

    async def scenario() -> None:
        forecasts.next = prediction(1.3)  # the queues grow: 1.2 s queued
        tight = asyncio.ensure_future(slo.admit(request(slo, INTERACTIVE, rid="tight")))
        await asyncio.sleep(0.01)
        assert not tight.done()  # 1.3 s misses its 1 s: it waits in the gate
        loose = asyncio.ensure_future(slo.admit(request(slo, INTERACTIVE, LOOSE, "loose")))
        await asyncio.sleep(0.12)
        assert not loose.done()  # it fits its 3 s, but 1.2 s queued is more than 0.9 s
        forecasts.next = prediction(0.5)  # the queue drains to 0.4 s
        await asyncio.wait_for(asyncio.gather(tight, loose), 0.5)

    asyncio.run(scenario())
    metrics.flush()
    assert metrics.registry.get_sample_value(
        "gateway_slo_requests_total", {"priority": "interactive", "outcome": "queued"}) == 2
