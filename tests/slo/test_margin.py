"""The gate's margin (gateway/slo/margin.py): the quantile of observed / forecast TTFT."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from gateway.errors import TooManyRequests
from gateway.slo.margin import HIGH, LOW, MAX_AGE, QUANTILE, WARM, Margin
from gateway.slo.model import Prediction
from tests.slo.test_gate import BATCH, Forecasts, gate, request


def test_the_margin_is_the_quantile_of_how_late_forecasts_run() -> None:
    rng = random.Random(7)
    margin = Margin()
    ratios = [rng.uniform(0.5, 2.0) for _ in range(256)]
    for ratio in ratios[:WARM - 1]:
        margin.observe(ratio, 1.0)
    assert margin.value == 1.0  # too few to say
    for ratio in ratios[WARM - 1:]:
        margin.observe(ratio * 0.2, 0.2)  # the ratio counts, not the seconds
    expected = sorted(ratios)[int(QUANTILE * len(ratios)) - 1]
    assert margin.value == pytest.approx(expected, rel=0.02)
    late = sum(r > margin.value for r in ratios) / len(ratios)
    assert late == pytest.approx(1 - QUANTILE, abs=0.02)


@pytest.mark.parametrize(("ratio", "bound"), [(100.0, HIGH), (0.01, LOW)])
def test_odd_forecasts_cannot_push_the_margin_past_its_bounds(ratio, bound) -> None:
    margin = Margin()
    for _ in range(64):
        margin.observe(ratio, 1.0)
    assert margin.value == bound


def test_the_window_forgets_what_it_saw_long_ago() -> None:
    margin = Margin()
    for _ in range(256):
        margin.observe(3.0, 1.0)
    assert margin.value == pytest.approx(3.0)
    for _ in range(256):
        margin.observe(1.1, 1.0)
    assert margin.value == pytest.approx(1.1)


def test_the_gate_tests_the_forecast_times_the_margin() -> None:
    """A forecast of 0.8 s against a 1 s objective passes alone, and is shed once forecasts
    have been running 1.5x late."""
    slo, _ = gate(Forecasts(0.8))
    asyncio.run(slo.admit(request(slo, BATCH)))
    for _ in range(WARM):
        slo.margin.observe(1.5, 1.0)
    with pytest.raises(TooManyRequests) as refused:
        asyncio.run(slo.admit(request(slo, BATCH)))
    assert refused.value.headers["retry-after"] == "1"


def test_forecasts_on_the_prior_speed_do_not_move_the_margin() -> None:
    """A cold start's forecasts use the prior's speed (several times short on a slower
    model) until the prefills report theirs: their ratios would hold the margin near its
    ceiling for a whole window after the speed is known, refusing what measured forecasts
    admit. Only forecasts on a measured speed teach it."""
    from dataclasses import replace
    from types import SimpleNamespace

    from tests.slo.test_gate import INTERACTIVE, prediction

    slo, _ = gate(Forecasts(0.5))
    model = SimpleNamespace(observe=lambda *args: None, release=lambda *args: None)
    for i in range(2 * WARM):
        for measured in (False, True):
            rid = f"r{i}{measured}"
            view = request(slo, INTERACTIVE, rid=rid)
            view.slo.model, view.slo.picked_at = model, 100.0
            view.slo.prediction = replace(prediction(0.5), measured=measured)
            ttft = 0.5 if measured else 3.0  # the prior's forecasts ran 6x short
            slo.observe(SimpleNamespace(request_id=rid, status=200, ttft=ttft, started=100.0,
                                        stream=True, completion=11, duration=ttft + 0.5,
                                        prompt=100))
    assert slo.margin.value == pytest.approx(1.0)


def test_ratios_older_than_max_age_leave_the_margin() -> None:
    """A burst of late answers (a server lost under load) must not hold the margin for a
    whole window of later traffic: a class with little traffic would wait minutes."""
    margin = Margin()
    for i in range(WARM):
        margin.observe(4.0, 1.0, now=float(i) / WARM)
    assert margin.factor(now=1.0) == pytest.approx(4.0)
    later = 1.0 + MAX_AGE
    for i in range(WARM):
        margin.observe(1.1, 1.0, now=later + i / WARM)
    assert margin.factor(now=later + 1) == pytest.approx(1.1)  # (a count window: 4.0)


def test_a_margin_nothing_measures_again_lapses_and_the_gate_admits() -> None:
    """Only what the gate admits teaches the margin: a margin left at 4 by old errors
    would refuse a class whose forecasts it pushes past their objective for ever, on an
    idle cluster. With no ratio for MAX_AGE seconds it is 1 again."""
    slo, _ = gate(Forecasts(0.4))  # 0.4 s forecast, 1 s objective: fits unless 2.5x late
    for _ in range(WARM):
        slo.margin.observe(4.0, 1.0)
    with pytest.raises(TooManyRequests):
        asyncio.run(slo.admit(request(slo, BATCH)))
    slo, _ = gate(Forecasts(0.4))
    then = time.monotonic() - MAX_AGE - 1
    for _ in range(WARM):
        slo.margin.observe(4.0, 1.0, now=then)
    assert slo.margin.value == pytest.approx(4.0)
    asyncio.run(slo.admit(request(slo, BATCH)))  # admitted: the margin lapsed to 1


def test_a_margin_left_high_refuses_nothing_an_idle_pair_can_serve() -> None:
    """The margin is how late forecasts ran under queues and running batches; an idle pair
    (nothing queued at its prefill, a decode step's admission) has neither, and what it
    admits teaches the margin again. CI's paired-fault flood: a prefill back from a restart,
    idle, got no batch request for 20 s while a margin left high by the survivor's late
    answers refused them all."""
    from dataclasses import replace

    from tests.slo.test_gate import prediction

    idle = Prediction(0.4, 0.01, 0.0, 0.35, 0.04, 0.01, 0.4, 0.01)  # wait 0, admit = a step
    forecasts = Forecasts(0.4)
    slo, _ = gate(forecasts)
    for _ in range(WARM):
        slo.margin.observe(4.0, 1.0)
    with pytest.raises(TooManyRequests):  # 0.05 s of it queued at the prefill: not idle
        asyncio.run(slo.admit(request(slo, BATCH)))
    forecasts.next = replace(idle, admit=0.2)  # the decode full: a queue there
    with pytest.raises(TooManyRequests):
        asyncio.run(slo.admit(request(slo, BATCH, rid="r2")))
    forecasts.next = replace(idle, ttft=1.2)  # an idle pair that misses even so
    with pytest.raises(TooManyRequests):
        asyncio.run(slo.admit(request(slo, BATCH, rid="r3")))
    forecasts.next = idle
    asyncio.run(slo.admit(request(slo, BATCH, rid="r4")))  # admitted on the bare forecast
    assert prediction(0.4).wait > 0  # (the other tests' forecasts all have a queue)


def test_idle_pairs_admit_one_request_at_a_time() -> None:
    """The pair a forecast calls idle need not be where the pick sends the request (`auto`
    keeps the cache-aware prefill; a prefill just killed looks idle until it is known dead):
    the next request admitted for an idle pair waits for the last one's forecast first
    token, so such admissions never draw a flood (docs/RELIABILITY.md: 22 batch requests
    admitted on a dead prefill's empty queue in 0.6 s)."""
    from tests.slo.test_gate import INTERACTIVE

    forecasts = Forecasts(0.4)
    forecasts.next = Prediction(0.3, 0.01, 0.0, 0.29, 0.0, 0.01, 0.3, 0.01)
    slo, _ = gate(forecasts)
    for _ in range(WARM):  # the margin at its ceiling: 4 x 0.3 s misses the 1 s objective
        slo.margin.observe(4.0, 1.0)
    asyncio.run(slo.admit(request(slo, BATCH, rid="r1")))  # on the idle pair
    with pytest.raises(TooManyRequests):  # the one before has not had its first token
        asyncio.run(slo.admit(request(slo, BATCH, rid="r2")))
    time.sleep(0.31)  # its forecast first token (0.3 s) has passed: the next may go
    asyncio.run(slo.admit(request(slo, INTERACTIVE, rid="r3")))


def test_an_idle_pair_counts_only_once_the_gate_let_nothing_through_for_a_while() -> None:
    """While requests pass the gate they teach the margin, and under load the pair a
    forecast calls idle is often not where the pick sends (the 2-core goodput runs admitted
    more onto the busy cache holders): an idle pair's bare forecast counts only after
    `QUIET` seconds in which no forecast fitted."""
    forecasts = Forecasts(0.4)
    forecasts.next = Prediction(0.3, 0.01, 0.0, 0.29, 0.0, 0.01, 0.3, 0.01)
    slo, _ = gate(forecasts)
    asyncio.run(slo.admit(request(slo, BATCH, rid="r1")))  # 0.3 s fits the 1 s: it passes
    for _ in range(WARM):
        slo.margin.observe(4.0, 1.0)
    with pytest.raises(TooManyRequests):  # 1.2 s with the margin; one passed just now
        asyncio.run(slo.admit(request(slo, BATCH, rid="r2")))


def _streamed(slo, rid: str, forecast: float, ttft: float) -> None:
    """One interactive request forecast at `forecast` s that streamed its first token
    `ttft` s after its pick (objective 1 s)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from tests.slo.test_gate import INTERACTIVE, prediction

    view = request(slo, INTERACTIVE, rid=rid)
    view.slo.model = SimpleNamespace(observe=lambda *args: None, release=lambda *args: None)
    view.slo.picked_at = 100.0
    view.slo.prediction = replace(prediction(forecast, compute=forecast / 2), measured=True)
    slo.observe(SimpleNamespace(request_id=rid, status=200, ttft=ttft, started=100.0,
                                stream=True, completion=11, duration=ttft + 0.5, prompt=100))


def test_short_forecasts_late_by_an_addend_do_not_hold_the_margin_at_its_ceiling() -> None:
    """A 50 ms forecast whose first token comes 0.2 s later (the batch already running on
    the prefill) ran 5x late, yet no margin refuses it (50 ms x 4 is under the 1 s objective);
    counted as 5x, such requests held the margin at its ceiling and the gate refused the
    long forecasts, which ran on time (8B device: 4,522 refused of 18,900 at 178-194
    requests/s, 1,406 once they count against the shortest forecast the margin can refuse)."""
    slo, _ = gate(Forecasts(0.4))
    for i in range(2 * WARM):
        _streamed(slo, f"r{i}", forecast=0.05, ttft=0.25)
    assert slo.margin.value == pytest.approx(1.0)  # 0.25 s against 1 s / HIGH
    asyncio.run(slo.admit(request(slo, BATCH, rid="next")))  # 0.4 s fits the 1 s


def test_forecasts_the_margin_can_refuse_still_teach_it_how_late_they_run() -> None:
    slo, _ = gate(Forecasts(0.6))
    asyncio.run(slo.admit(request(slo, BATCH, rid="first")))  # 0.6 s fits the 1 s
    for i in range(2 * WARM):
        _streamed(slo, f"r{i}", forecast=0.5, ttft=1.0)
    assert slo.margin.value == pytest.approx(2.0)
    with pytest.raises(TooManyRequests):  # 0.6 s forecasts now run 1.2 s
        asyncio.run(slo.admit(request(slo, BATCH, rid="next")))
