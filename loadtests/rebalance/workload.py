"""The shifting workload: phases of open-loop Poisson arrivals whose mix moves from long
outputs to long prompts and back, each request streamed with the objectives measured at the
client (TTFT <= 1.5 s, mean ITL <= 60 ms)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtests.routing.workloads import chat_body, poisson_times, words

TTFT_S, ITL_S = 1.5, 0.060


@dataclass(frozen=True)
class Phase:
    name: str
    duration: float  # seconds of arrivals
    rate: float  # requests per second
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the run's start
    phase: str
    body: dict


def plan(phases: tuple[Phase, ...], seed: int) -> list[Request]:
    """Every request of the run, in arrival order (the same for every split: one seed)."""
    rng = random.Random(seed)
    out: list[Request] = []
    start = 0.0
    for phase in phases:
        for at in poisson_times(rng, phase.rate, phase.duration):
            # a random head: no two prompts share a cached prefix
            text = f"{rng.getrandbits(48):012x} " + words(rng, phase.prompt_tokens - 4)
            body = chat_body([{"role": "user", "content": text}], phase.output_tokens)
            body["ignore_eos"] = True
            out.append(Request(start + at, phase.name, body))
        start += phase.duration
    return out


def attained(ttft: float | None, itl: float | None) -> bool:
    """Both objectives met (a one-chunk answer has no ITL to miss)."""
    return ttft is not None and ttft <= TTFT_S and (itl is None or itl <= ITL_S)
