"""The SLO gate (Conductor's early rejection): a request whose TTFT objective no pair is
predicted to meet does not start prefill work that is certain to miss.

Runs once the request holds its admission slot (gateway/admission/slots.py), just before
dispatch, so the forecast is of the servers as they are when it would be sent:

* no TTFT objective, or its class says `best_effort`: sent as today;
* the best pair's forecast meets the objective and, while other requests wait in the gate,
  puts no more queueing ahead of it than the tightest recent requests of its class or a more
  urgent one bear (slo/tolerance.py): sent (the joint policy picks that pair);
* nothing let through for `QUIET` seconds, the best pair idle (nothing queued at its
  prefill, room at its decode) and its forecast meeting the objective without the margin:
  sent, one such request at a time (`idle_fit`);
* else `shed` (batch by default): 429 with Retry-After (the predicted excess, at least 1 s),
  code `slo_unattainable`, nothing sent to any server;
* else `queue` (interactive, standard): it waits for a pair that can serve it in what is
  left of its objective (the `LOOK` most urgent waiters ask again whenever a request ends
  and every `POLL` seconds; the others only watch their own time);
  once even an idle pair could not (the wait used the budget up), 503 with Retry-After,
  nothing sent: a request certain to miss is not started.

When every request ends (the usage sink, gateway/observability/usage.py) the gate tells the
model what the client saw against what was forecast (TTFT from the pick, mean ITL of a
stream), feeds `gateway_slo_prediction_error`, and counts met / missed per class.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import time
from collections.abc import Callable

from gateway.errors import ServiceUnavailable, TooManyRequests
from gateway.request import RequestView
from gateway.slo.margin import Margin
from gateway.slo.model import Prediction
from gateway.slo.objectives import Objectives
from gateway.slo.ticket import Ticket
from gateway.slo.tolerance import Tolerance

POLL = 0.05  # seconds between looks of a queued request when nothing ends meanwhile
LOOK = 4  # queued requests that ask for forecasts (the most urgent)
QUIET = 1.0  # seconds of nothing let through before an idle pair's bare forecast may be
MAX_OPEN = 1 << 17  # tickets awaiting their request's end (a bound, should ends go unseen)
CLASSES = Objectives.CLASSES


class _Waiter:
    """A request queued in the gate: its urgency (class, since) and what wakes it."""

    __slots__ = ("key", "future")

    def __init__(self, key: tuple[int, float]) -> None:
        self.key = key
        self.future: asyncio.Future | None = None


def _urgency(waiter: _Waiter) -> tuple[int, float]:
    return waiter.key


class SloGate:
    def __init__(self, objectives: Objectives, forecast: Callable[[RequestView], Prediction],
                 metrics, learns: Callable[[RequestView], bool] | None = None) -> None:
        self.objectives = objectives
        self.forecast = forecast  # Scheduler.forecast
        # Scheduler.learns_from_every_request; None: every request gets a ticket
        self.learns = learns
        self.metrics = metrics
        self._open: dict[str, Ticket] = {}  # request id -> its ticket, until it ends
        self._waiting: list[_Waiter] = []  # queued requests, most urgent first
        self._outcomes: dict[tuple[int, str], object] = {}
        self.margin = Margin()  # forecasts run late by this much (slo/margin.py)
        self.tolerance = Tolerance(len(CLASSES))  # the queueing the tightest bear
        self._passed = -math.inf  # perf_counter() when a forecast last fitted
        self._idle_next = 0.0  # perf_counter() before which no request goes by `idle_fit`
        self._errors = {kind: metrics.buffered_histogram(
            metrics.slo_prediction_error.labels(kind)) for kind in ("ttft", "itl")}
        metrics.watch_slo(self)

    def waiting(self) -> int:
        """Requests queued in the gate now."""
        return len(self._waiting)

    def ticket(self, headers: list[tuple[bytes, bytes]], klass: int, request_id: str,
               view: RequestView) -> Ticket | None:
        """The request's objective (its headers, else its class's defaults; 400 if bad).
        None for a request without objectives whose policy would not learn from it: nothing
        of the gate is then spent on it (neither here nor when it ends)."""
        objective = self.objectives.of(headers, klass)
        if not objective.any and self.learns is not None and not self.learns(view):
            return None
        ticket = Ticket(objective)
        if len(self._open) >= MAX_OPEN:
            self._open.pop(next(iter(self._open)))
        self._open[request_id] = ticket
        return ticket

    async def admit(self, view: RequestView) -> None:
        """Return when `view` may be sent; raise when it must not start (see above)."""
        ticket = view.slo
        objective = ticket.objective if ticket is not None else None
        if objective is None or objective.ttft is None or objective.on_miss == "best_effort":
            return
        forecast = self.forecast(view)
        now = time.perf_counter()
        left = objective.ttft - (now - ticket.since)  # queued before: spent
        if forecast is None:
            return
        klass = objective.klass
        late, queued = self._late(forecast)
        self.tolerance.observe(klass, objective.ttft - (late - queued))
        excess = self._excess(late, queued, left, klass)
        if self._passes(excess, forecast, left, now):
            return
        if objective.on_miss == "shed":
            ticket.shed = True
            self._count(klass, "shed")
            raise TooManyRequests(
                f"no server pair can start this request within its time-to-first-token "
                f"objective ({objective.ttft * 1e3:g} ms; predicted {late * 1e3:.0f} ms, "
                f"{queued * 1e3:.0f} ms of it queued) while the queues stay as short as the "
                "tightest objectives need; nothing was sent; retry later",
                code="slo_unattainable", headers={"retry-after": _seconds(excess)})
        self._count(klass, "queued")
        await self._wait(view, left, klass, forecast.compute + forecast.transfer)

    def _passes(self, excess: float, forecast: Prediction, left: float, now: float) -> bool:
        """Whether a request goes: its forecast fits (`excess` <= 0); or, once the gate let
        nothing go for `QUIET` seconds, an idle pair's bare forecast fits (`idle_fit`), one
        such request at a time. The pair the forecast calls idle need not be where the pick
        sends the request (`auto` keeps the cache-aware prefill, and a prefill dead but not
        yet known as such looks idle), so the next waits until this one's forecast first
        token and none draws a flood; under load requests pass anyway and teach the margin."""
        if excess <= 0:
            self._passed = now
            return True
        if now - self._passed < QUIET or now < self._idle_next or \
                not idle_fit(forecast, left):
            return False
        self._idle_next = now + forecast.ttft
        return True

    def _late(self, forecast: Prediction) -> tuple[float, float]:
        """The forecast TTFT as late as the margin assumes, and the queued part of it (the
        waits at the prefill and the decode, not the request's own work)."""
        late = self.margin.late(forecast.ttft)
        raw = forecast.raw_ttft
        queued = late * (forecast.wait + forecast.admit) / raw if raw > 0 else 0.0
        return late, queued

    def _excess(self, late: float, queued: float, left: float, klass: int) -> float:
        """Seconds by which a forecast misses its own objective's `left`, or, while requests
        wait in the gate (some did not fit), the queueing that the tightest requests of the
        class bear (slo/tolerance.py); <= 0 when it fits."""
        bound = self.tolerance.bound(klass) if self._waiting else math.inf
        return max(late - left, queued - bound)

    async def _wait(self, view: RequestView, budget: float, klass: int,
                    floor: float) -> None:
        """Wait for a pair that can meet what is left of `budget` (seconds from now); `floor`
        is the request's own compute and transfer (under it even an idle pair misses). Only
        the `LOOK` most urgent waiters (class, then age) ask for forecasts, when a request
        ends and every `POLL` seconds: waiting costs no CPU per waiter under overload."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        waiter = _Waiter((klass, started))
        bisect.insort(self._waiting, waiter, key=_urgency)
        try:
            while True:
                waiter.future = loop.create_future()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.future, POLL)
                now = time.perf_counter()
                left = budget - (now - started)
                if self._waiting.index(waiter) < LOOK:
                    forecast = self.forecast(view)
                    if forecast is None:
                        return
                    late, queued = self._late(forecast)
                    excess = self._excess(late, queued, left, klass)
                    if self._passes(excess, forecast, left, now):
                        return
                    floor = forecast.compute + forecast.transfer
                else:
                    excess = budget
                if left <= floor:  # not even an idle pair could make it now: a certain miss
                    view.slo.shed = True
                    self._count(klass, "shed")
                    raise ServiceUnavailable(
                        f"no server pair could start this request within its time-to-first-"
                        f"token objective ({view.slo.objective.ttft * 1e3:g} ms) while it "
                        "waited; nothing was "
                        "sent; retry later", code="slo_unattainable",
                        headers={"retry-after": _seconds(excess)})
        finally:
            self._waiting.remove(waiter)

    # -- when a request ends (the usage sink) --------------------------------------------------

    def sink(self, then: Callable | None) -> Callable:
        """The usage sink: observe each ended request, then pass it on (the access log)."""
        def observe_then(record) -> None:
            self.observe(record)
            if then is not None:
                then(record)
        return observe_then

    def observe(self, record) -> None:
        """Learn from one ended request (observability/usage.RequestUsage) and count it."""
        ticket = self._open.pop(record.request_id, None)
        for waiter in self._waiting[:LOOK]:  # a slot may have freed: the first look again
            if waiter.future is not None and not waiter.future.done():
                waiter.future.set_result(None)
        if ticket is None:
            return
        ticket.release()
        ok = 200 <= record.status < 300 and record.ttft is not None
        ttft, itl = self._seen(ticket, record) if ok else (None, None)
        predicted = ticket.prediction
        if predicted is not None and ticket.model is not None:
            learned = ticket.first_seen is not None  # at the first token (Ticket.first_token)
            ticket.model.observe(ticket.target_url, ticket.decode_url, predicted,
                                 None if learned else ttft, itl,
                                 record.duration - record.ttft if ok else None,
                                 (record.prompt or 0) + (record.completion or 0))
            if ttft is not None:
                self._errors["ttft"].observe(ttft / max(predicted.ttft, 1e-6))
                if predicted.measured:  # the margin is the measured forecasts' error
                    self.margin.observe(ttft, predicted.ttft,
                                        objective=ticket.objective.ttft)
            if itl is not None:
                self._errors["itl"].observe(itl / max(predicted.itl, 1e-6))
        objective = ticket.objective
        if objective.any and not ticket.shed:  # a shed request is counted as such
            met = ok and (objective.ttft is None or record.ttft <= objective.ttft) and \
                (objective.itl is None or itl is None or itl <= objective.itl)
            self._count(objective.klass, "met" if met else "missed")

    @staticmethod
    def _seen(ticket: Ticket, record) -> tuple[float | None, float | None]:
        """(TTFT from the pick, mean ITL) the client saw; a whole answer's TTFT is its end,
        so only streams teach the model."""
        if not record.stream or not ticket.picked_at:
            return None, None
        ttft = record.started + record.ttft - ticket.picked_at
        itl = None
        if record.completion and record.completion > 1 and record.duration:
            itl = (record.duration - record.ttft) / (record.completion - 1)
        return ttft, itl

    def _count(self, klass: int, outcome: str) -> None:
        key = (klass, outcome)
        counter = self._outcomes.get(key)
        if counter is None:
            m = self.metrics
            counter = self._outcomes[key] = m.buffered_counter(
                m.slo_outcomes.labels(CLASSES[klass], outcome))
        counter.inc()


def idle_fit(forecast: Prediction, left: float) -> bool:
    """Whether the forecast's pair is idle (nothing queued at its prefill, room at its
    decode) and meets `left` seconds without the margin. The margin is how late forecasts
    ran, and that lateness is the queues' and the running batch's (docs/SCHEDULING.md, "The
    margin"), which an idle pair has neither of; and only what the gate admits teaches the
    margin. Without this, a margin left high by a burst refused an idle cluster everything
    for up to `MAX_AGE` (CI: a restarted prefill got no batch request in 20 s)."""
    return forecast.wait <= 0.0 and forecast.admit <= forecast.raw_itl and \
        forecast.ttft <= left


def _seconds(excess: float) -> str:
    return str(max(1, math.ceil(excess)))
