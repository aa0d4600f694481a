"""What travels with one request through the SLO machinery: its objective, and the forecast
of the pair it was sent to (written by the joint policy when it picks), so the model learns
the TTFT it forecast as the first token is relayed, and the gate compares the rest with what
the client saw when the request ends."""

from __future__ import annotations

import time

from gateway.slo.model import LatencyModel, Prediction
from gateway.slo.objectives import Objective


class Ticket:
    """One request's objective and, once picked, its pair's forecast."""

    __slots__ = ("objective", "since", "prediction", "picked_at", "target_url", "decode_url",
                 "model", "held", "shed", "first_seen")

    def __init__(self, objective: Objective) -> None:
        self.objective = objective
        # time.perf_counter() when the request was read: its TTFT objective counts from here
        # (the admission queue and the gate's own wait use it up), not from the gate
        self.since = time.perf_counter()
        self.prediction: Prediction | None = None
        self.picked_at = 0.0  # time.perf_counter() of the pick
        self.target_url = ""
        self.decode_url = ""
        self.model: LatencyModel | None = None  # the model that forecast it
        self.held: str | None = None  # the decode whose ITL bounds count this request
        self.shed = False  # refused by the SLO gate
        self.first_seen: float | None = None  # TTFT from the pick, once the first token came

    def picked(self, model: LatencyModel, target_url: str, decode_url: str,
               prediction: Prediction, now: float) -> None:
        """The joint policy sent it to (target, decode) with this forecast; the decode now
        counts its ITL objective among those of its running requests (`release` undoes)."""
        self.release()
        self.model, self.prediction, self.picked_at = model, prediction, now
        self.first_seen = None
        self.target_url, self.decode_url = target_url, decode_url
        if self.objective.itl is not None:
            model.hold(decode_url, self.objective.itl)
            self.held = decode_url

    def first_token(self, now: float) -> None:
        """The stream's first token reached the client (`now`, time.perf_counter()): the
        model learns this TTFT at once. Learning it when the request ends came a decode's
        whole answer late (seconds under load), and a model that learns late lets a sudden
        overload in: the gate admitted on forecasts 2.5x too low (docs/SCHEDULING.md)."""
        model, prediction = self.model, self.prediction
        if model is None or prediction is None or self.first_seen is not None:
            return
        self.first_seen = now - self.picked_at
        model.learn_ttft(self.target_url, self.decode_url, prediction, self.first_seen)

    def release(self) -> None:
        """The request left its decode (ended, or retried elsewhere)."""
        if self.held is not None and self.model is not None:
            self.model.release(self.held, self.objective.itl)
            self.held = None
