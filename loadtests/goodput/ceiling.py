"""A ceiling no placement can pass: the rate the decodes' KV pools sustain, by Little's law.

The capacity bound of `capacity.py` is a strong placement, not a proven optimum: a router may
beat it. This ceiling is proven, and it holds for any router and any prefill placement,
because what it counts does not depend on placement: every request holds its context's KV
on its decode (prompt plus the tokens generated so far; SGLang's decode reserves even more,
`DecodePreallocQueue` allocating the prompt before the transfer) for each of its decode steps,
and no step is shorter than an empty batch's (`TimingProfile.decode_ms(1, 0)`, the weight
read). In a steady state the KV held on average is the arrival rate times each request's
token-seconds (Little's law), and it cannot pass the pools' sum, so

    rate <= decodes * kv_tokens / (mean token-steps per request * shortest step)

where a request with prompt p and n output tokens takes n - 1 decode steps (its first token
comes with the prefill) holding p + 1, ..., p + n - 1 tokens. A router whose goodput reads
above the ceiling was measured in a transient (the pools still filling), not a steady state;
a goal above it is out of reach on that cluster for every router (docs/BENCHMARKS.md, "The
decode ceiling").
"""

from __future__ import annotations

from loadtests.goodput.physics import Physics
from loadtests.goodput.workload import MixShape, Plan, mixed_plan

SECONDS = 120.0  # of arrivals drawn to average the mix over (the mean settles well before)


def token_steps(prompt: int, output: int) -> int:
    """KV tokens held, summed over a request's decode steps."""
    steps = max(0, output - 1)
    return steps * prompt + steps * (steps + 1) // 2


def mean_token_steps(plan: Plan) -> float:
    requests = plan.requests
    if not requests:
        return 0.0
    return sum(token_steps(r.prompt_tokens, r.max_tokens) for r in requests) / len(requests)


def decode_ceiling(shape: MixShape, rate: float, seed: int, decodes: int,
                   physics: Physics) -> float:
    """The highest rate (requests/s) the decodes' pools could hold in a steady state of
    `shape`'s mix, drawn at `rate` (the mix barely moves with it: conversations cut by the
    plan's end are its only dependence)."""
    held = mean_token_steps(mixed_plan(shape, rate, SECONDS, seed))
    shortest = physics.decode_step_ms(1, 0) / 1e3
    if held <= 0 or shortest <= 0:
        return float("inf")
    return decodes * physics.kv_tokens / (held * shortest)
