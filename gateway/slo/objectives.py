"""A request's latency objectives: its headers, else its class's defaults from the settings.

Headers (exact names, milliseconds, > 0): `x-slo-ttft-ms` (time to first token) and
`x-slo-itl-ms` (mean inter-token latency). A header the client sets wins over its class's
default; a request with neither, in a class without defaults, has no objective and is served
as before (best effort, never refused by the SLO gate).

`--slo-classes` (JSON, keyed by class: interactive, standard, batch) gives each class its
defaults and what happens when no pair is predicted to meet its TTFT objective (`on_miss`):
`queue` waits for one that can, bounded by the objective itself; `shed` answers 429 with
Retry-After at once, before any prefill work; `best_effort` sends it anyway. Without an
`on_miss` a class keeps the rule of its kind: interactive and standard queue, batch sheds.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic
from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.errors import BadRequest

TTFT_HEADER = b"x-slo-ttft-ms"
ITL_HEADER = b"x-slo-itl-ms"
MAX_MS = 3_600_000.0
OnMiss = Literal["queue", "shed", "best_effort"]
DEFAULT_ON_MISS: tuple[str, ...] = ("queue", "queue", "shed")  # by class index
Millis = Annotated[float, Field(gt=0, le=MAX_MS)]


@dataclass(frozen=True, config=pydantic.ConfigDict(extra="forbid"))
class SloClass:
    """One class's objectives (milliseconds) and its rule when they cannot be met."""

    ttft_ms: Millis | None = None
    itl_ms: Millis | None = None
    on_miss: OnMiss | None = None


@dataclass(frozen=True)
class Objective:
    """What one request asks for (seconds; None: no bound) and what to do on a miss."""

    ttft: float | None
    itl: float | None
    on_miss: str
    klass: int

    @property
    def any(self) -> bool:
        return self.ttft is not None or self.itl is not None


def _millis(name: bytes, value: bytes) -> float:
    try:
        ms = float(value) if len(value) <= 32 else math_nan()
    except ValueError:
        ms = math_nan()
    if not 0 < ms <= MAX_MS:  # also NaN and inf
        raise BadRequest(f"header {name.decode()!r} must be milliseconds, > 0 and <= "
                         f"{MAX_MS:g}", code="invalid_header")
    return ms


def math_nan() -> float:
    return float("nan")


class Objectives:
    """The class defaults of the settings, and the reading of the two headers."""

    CLASSES = ("interactive", "standard", "batch")

    def __init__(self, classes: dict[str, SloClass] | None) -> None:
        classes = classes or {}
        self.defaults = [classes.get(name) or SloClass() for name in self.CLASSES]
        # a request that sets neither header (most) gets its class's objective, built once
        self._plain = [self._objective(d.ttft_ms, d.itl_ms, k)
                       for k, d in enumerate(self.defaults)]

    def of(self, headers: list[tuple[bytes, bytes]], klass: int) -> Objective:
        """The objective of a request of class `klass` with these headers (400 if bad)."""
        default = self.defaults[klass]
        ttft = default.ttft_ms
        itl = default.itl_ms
        given = False
        for name, value in headers:
            if name == TTFT_HEADER:
                ttft, given = _millis(name, value), True
            elif name == ITL_HEADER:
                itl, given = _millis(name, value), True
        return self._objective(ttft, itl, klass) if given else self._plain[klass]

    def _objective(self, ttft: float | None, itl: float | None, klass: int) -> Objective:
        return Objective(ttft / 1e3 if ttft is not None else None,
                         itl / 1e3 if itl is not None else None,
                         self.defaults[klass].on_miss or DEFAULT_ON_MISS[klass], klass)
