"""The SLO gate: what happens to a request no pair is predicted to serve in time (no sockets)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from gateway.errors import ServiceUnavailable, TooManyRequests
from gateway.observability.metrics import Metrics
from gateway.servers.pool import ServerPool
from gateway.slo.gate import SloGate
from gateway.slo.margin import WARM
from gateway.slo.model import Prediction
from gateway.slo.objectives import Objectives, SloClass
from tests.unit.builders import generate_ids

CLASSES = {"interactive": SloClass(ttft_ms=1000), "batch": SloClass(ttft_ms=1000),
           "standard": SloClass(ttft_ms=1000, on_miss="best_effort")}
INTERACTIVE, STANDARD, BATCH = 0, 1, 2


def prediction(ttft: float, compute: float = 0.1) -> Prediction:
    return Prediction(ttft, 0.01, ttft - compute, compute, 0.0, 0.0, ttft, 0.01)


class Forecasts:
    """A forecast that the test changes; counts the questions."""

    def __init__(self, ttft: float, compute: float = 0.1) -> None:
        self.next = prediction(ttft, compute)
        self.asked = 0

    def __call__(self, view) -> Prediction:
        self.asked += 1
        return self.next


def gate(forecasts: Forecasts) -> tuple[SloGate, Metrics]:
    metrics = Metrics(CollectorRegistry(), ServerPool())
    return SloGate(Objectives(CLASSES), forecasts, metrics), metrics


def request(slo: SloGate, klass: int, headers=(), rid: str = "r1"):
    view = generate_ids(list(range(100)))
    view.slo = slo.ticket(list(headers), klass, rid, view)
    return view


def count(metrics: Metrics, klass: str, outcome: str) -> float:
    metrics.flush()
    return metrics.registry.get_sample_value(
        "gateway_slo_requests_total", {"priority": klass, "outcome": outcome}) or 0.0


def test_batch_that_cannot_meet_its_objective_is_shed_with_retry_after() -> None:
    slo, metrics = gate(Forecasts(3.4))
    with pytest.raises(TooManyRequests) as refused:
        asyncio.run(slo.admit(request(slo, BATCH)))
    assert refused.value.status == 429
    assert refused.value.headers["retry-after"] == "3"
    assert refused.value.code == "slo_unattainable"
    assert count(metrics, "batch", "shed") == 1


def test_the_objective_counts_from_the_request_not_from_the_gate() -> None:
    """A batch request that waited 0.5 s for an admission slot has 0.5 s of its 1 s
    objective left: a pair predicted at 0.7 s no longer meets it."""
    slo, metrics = gate(Forecasts(0.7))
    view = request(slo, BATCH)
    view.slo.since -= 0.5  # read half a second ago (the admission queue)
    with pytest.raises(TooManyRequests):
        asyncio.run(slo.admit(view))
    assert count(metrics, "batch", "shed") == 1
    asyncio.run(slo.admit(request(slo, BATCH, rid="r2")))  # just read: 0.7 s meets 1 s


@pytest.mark.parametrize(("klass", "headers"), [
    pytest.param(STANDARD, (), id="best_effort_class"),
    pytest.param(INTERACTIVE, ((b"x-slo-ttft-ms", b"5000"),), id="header_objective_met"),
])
def test_requests_that_may_go_are_not_held(klass, headers) -> None:
    slo, _ = gate(Forecasts(3.0))
    started = time.perf_counter()
    asyncio.run(slo.admit(request(slo, klass, headers)))
    assert time.perf_counter() - started < 0.05


def test_without_an_objective_no_forecast_is_made() -> None:
    forecasts = Forecasts(30.0)
    slo = SloGate(Objectives(None), forecasts, Metrics(CollectorRegistry(), ServerPool()))
    asyncio.run(slo.admit(request(slo, BATCH)))
    assert forecasts.asked == 0


def test_interactive_waits_until_a_pair_can_meet_it() -> None:
    forecasts = Forecasts(3.0)
    slo, metrics = gate(forecasts)

    async def scenario() -> float:
        waiting = asyncio.ensure_future(slo.admit(request(slo, INTERACTIVE)))
        await asyncio.sleep(0.12)
        assert not waiting.done()  # still over the objective: it waits
        forecasts.next = prediction(0.5)
        slo.observe(SimpleNamespace(request_id="other", status=200, ttft=None))  # one ended
        started = time.perf_counter()
        await asyncio.wait_for(waiting, 1.0)
        return time.perf_counter() - started

    assert asyncio.run(scenario()) < 0.04  # woken by the end, not by the next poll
    assert count(metrics, "interactive", "queued") == 1


def test_interactive_that_used_up_its_budget_waiting_is_refused() -> None:
    slo, metrics = gate(Forecasts(3.0, compute=0.9))
    started = time.perf_counter()
    with pytest.raises(ServiceUnavailable) as refused:
        asyncio.run(slo.admit(request(slo, INTERACTIVE)))
    assert time.perf_counter() - started < 0.5  # not the whole objective: it could not make it
    assert refused.value.status == 503 and "retry-after" in refused.value.headers
    assert count(metrics, "interactive", "shed") == 1


def test_ended_requests_teach_the_model_and_count_met_or_missed() -> None:
    slo, metrics = gate(Forecasts(0.5))
    learned = []
    model = SimpleNamespace(observe=lambda *args: learned.append(args),
                            release=lambda *args: None)
    for rid, ttft in (("fast", 0.4), ("slow", 1.5)):
        view = request(slo, INTERACTIVE, rid=rid)
        view.slo.model, view.slo.prediction = model, prediction(0.5)
        view.slo.picked_at = 100.0
        slo.observe(SimpleNamespace(request_id=rid, status=200, ttft=ttft, started=100.0,
                                    stream=True, completion=11, duration=ttft + 0.5,
                                    prompt=100))
    assert count(metrics, "interactive", "met") == 1
    assert count(metrics, "interactive", "missed") == 1
    assert [round(args[3], 3) for args in learned] == [0.4, 1.5]  # TTFT from the pick
    assert [round(args[4], 3) for args in learned] == [0.05, 0.05]  # (0.5 s / 10 gaps)


def test_a_streams_first_token_teaches_the_ttft_at_once_and_only_once() -> None:
    """The model learns a stream's TTFT when its first token is relayed, not a whole answer
    later; the end then teaches only the ITL and the time on the decode. A retry (a new
    pick) is learned again from its own pick."""
    slo, metrics = gate(Forecasts(0.5))
    learned = []
    model = SimpleNamespace(observe=lambda *args: learned.append(args),
                            # recorded as `observe` would be with the TTFT alone (no ITL)
                            learn_ttft=lambda *args: learned.append((*args, None)),
                            release=lambda *args: None, hold=lambda *args: None)
    view = request(slo, INTERACTIVE, rid="r")
    view.slo.picked(model, "p", "d", prediction(0.5), 100.0)
    view.slo.first_token(100.7)
    view.slo.first_token(100.9)  # a later chunk of the same pick: nothing new
    assert [(a[0], a[1], round(a[3], 3), a[4]) for a in learned] == [("p", "d", 0.7, None)]
    slo.observe(SimpleNamespace(request_id="r", status=200, ttft=0.7, started=100.0,
                                stream=True, completion=11, duration=1.2, prompt=89))
    assert len(learned) == 2 and learned[1][3] is None  # the TTFT was learned already
    assert round(learned[1][4], 3) == 0.05 and round(learned[1][5], 3) == 0.5
    assert learned[1][6] == 100  # the KV it held: prompt and completion tokens
    assert count(metrics, "interactive", "met") == 1
    view.slo.picked(model, "p2", "d", prediction(0.5), 200.0)  # a retry elsewhere
    view.slo.first_token(200.3)
    assert (learned[2][0], round(learned[2][3], 3)) == ("p2", 0.3)


def test_queued_requests_do_not_each_ask_for_forecasts() -> None:
    forecasts = Forecasts(3.0)
    slo, _ = gate(forecasts)

    async def scenario() -> None:
        views = [request(slo, INTERACTIVE, rid=f"r{i}") for i in range(40)]
        waiting = [asyncio.ensure_future(slo.admit(v)) for v in views]
        await asyncio.sleep(0.3)  # six polls
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(scenario())
    # 40 at arrival, then the 4 most urgent per poll (every waiter per poll: 280)
    assert 40 < forecasts.asked < 80
    assert slo._waiting == []


def test_the_gates_margin_queue_and_bounds_are_gauges() -> None:
    """An operator whose gate refuses while the servers idle reads why on /metrics: the
    margin (how late forecasts ran), requests queued in the gate, each class's bound."""
    slo, metrics = gate(Forecasts(5.0, compute=0.1))

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert value("gateway_slo_margin") == 1.0
    assert value("gateway_slo_queue_bound_seconds", priority="batch") == float("inf")
    for _ in range(WARM):
        slo.margin.observe(2.5, 1.0)
    assert value("gateway_slo_margin") == 2.5

    async def queued() -> float | None:
        held = asyncio.create_task(slo.admit(request(slo, INTERACTIVE)))
        await asyncio.sleep(0.01)
        seen = value("gateway_slo_waiting")
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        return seen

    assert value("gateway_slo_waiting") == 0
    assert asyncio.run(queued()) == 1
    assert value("gateway_slo_waiting") == 0


@pytest.mark.parametrize("learns", [False, True])
def test_a_request_without_objectives_gets_a_ticket_only_where_its_policy_learns(learns) -> None:
    """`auto` places a request without objectives by cache_aware and learns nothing from
    it: the gate opens no ticket for it (nothing kept until it ends); `slo` forecasts every
    request and learns from each, so each gets one. An objective always gets its ticket."""
    asked = []

    def learns_from(view) -> bool:
        asked.append(view)
        return learns

    slo = SloGate(Objectives(None), Forecasts(1.0), Metrics(CollectorRegistry(), ServerPool()),
                  learns_from)
    view = generate_ids(list(range(100)))
    ticket = slo.ticket([], STANDARD, "plain", view)
    assert (ticket is not None) is learns
    assert asked == [view]
    assert ("plain" in slo._open) is learns
    stated = slo.ticket([(b"x-slo-ttft-ms", b"800")], STANDARD, "stated", view)
    assert stated is not None and stated.objective.ttft == 0.8
    asyncio.run(slo.admit(view))  # a view without a ticket passes the gate
    slo.observe(SimpleNamespace(request_id="plain", status=200, ttft=0.1, stream=False,
                                duration=0.2, prompt=100, completion=1))  # ends quietly
    assert "plain" not in slo._open


def test_a_class_objective_read_without_headers_equals_one_read_with_them() -> None:
    objectives = Objectives(CLASSES)
    plain = objectives.of([(b"x-other", b"1")], BATCH)
    assert (plain.ttft, plain.itl, plain.on_miss, plain.klass) == (1.0, None, "shed", BATCH)
    stated = objectives.of([(b"x-slo-itl-ms", b"50")], BATCH)
    assert (stated.ttft, stated.itl, stated.on_miss) == (1.0, 0.05, "shed")
    assert objectives.of([], STANDARD).on_miss == "best_effort"
