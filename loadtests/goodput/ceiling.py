"""A ceiling no placement can pass: what the decodes complete per second in a steady state.

The capacity bound of `capacity.py` is a strong placement, not a proven optimum: a router may
beat it. This ceiling is proven for any router and any prefill placement, because what it
counts does not depend on placement. A request with prompt p and n output tokens takes n - 1
decode steps (its first token comes with the prefill), holding p + 1, ..., p + n - 1 tokens of
KV on its decode; whichever prefill computed it, that work is the same. A decode runs its steps
one after another, each taking (`TimingProfile.decode_ms`, the physics the servers compute
with)

    step = step_ms + ms_per_req x batch + ms_per_kv_token x context held by the batch

and no step holds more than the pool (`kv_tokens`). So over a long time T, a decode that
completes requests at rate r spends at least

    r T (token_steps x (step_ms / kv_tokens + ms_per_kv_token) + request_steps x ms_per_req)

in steps (the fewest steps are full ones), which cannot pass T. Summed over the decodes:

    completed per second <= decodes / (mean token-steps x (step_ms / kv_tokens + ms_per_kv_token)
                                       + mean request-steps x ms_per_req)

It counts completions, not the nominal rate a plan is drawn at (a plan offers fewer requests
than its rate: conversations cut by its end). A goodput's rate whose plans offer more than
ceiling / 0.9 requests per second cannot attain 90% in a steady state; a short plan can read
past it while the pools fill (docs/BENCHMARKS.md, "The decode ceiling").
"""

from __future__ import annotations

from loadtests.goodput.physics import Physics
from loadtests.goodput.workload import MixShape, Plan, mixed_plan

SECONDS = 120.0  # of arrivals drawn to average the mix over (the mean settles well before)


def decode_steps(output: int) -> int:
    """A request's decode steps: its first token comes with the prefill."""
    return max(0, output - 1)


def token_steps(prompt: int, output: int) -> int:
    """KV tokens held, summed over a request's decode steps."""
    steps = decode_steps(output)
    return steps * prompt + steps * (steps + 1) // 2


def mean_token_steps(plan: Plan) -> float:
    requests = plan.requests
    if not requests:
        return 0.0
    return sum(token_steps(r.prompt_tokens, r.max_tokens) for r in requests) / len(requests)


def decode_ceiling(shape: MixShape, rate: float, seed: int, decodes: int,
                   physics: Physics) -> float:
    """Requests per second the decodes could complete in a steady state of `shape`'s mix,
    drawn at `rate` (the mix barely moves with it: conversations cut by the plan's end are
    its only dependence)."""
    plan = mixed_plan(shape, rate, SECONDS, seed)
    if not plan.requests:
        return float("inf")
    held = mean_token_steps(plan)
    steps = sum(decode_steps(r.max_tokens) for r in plan.requests) / len(plan.requests)
    one = physics.decode_step_ms(1, 0)  # the physics' three coefficients, read back
    per_request = physics.decode_step_ms(2, 0) - one
    per_token = physics.decode_step_ms(1, 1) - one
    fixed = one - per_request
    seconds = (held * (fixed / physics.kv_tokens + per_token) + steps * per_request) / 1e3
    return decodes / seconds if seconds > 0 else float("inf")
