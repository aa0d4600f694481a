"""auto (the default for both roles, with `steer` off): a request that carries latency
objectives gets its decode, and its forecast for the SLO gate, from the joint `slo` scorer,
and keeps the cache-aware prefill unless `steer` is on; a request without keeps `cache_aware`
(prefill) and `least_load` (decode) exactly (docs/SCHEDULING.md, "The default policy, and
`auto`").

Objectives are the headers `x-slo-ttft-ms` / `x-slo-itl-ms` or the defaults of the request's
class in `--slo-classes` (gateway/slo/objectives.py). A client that states an objective asks
the gateway to meet it, so the pair is chosen by the predicted TTFT and ITL against it, and
the SLO gate can hold or refuse it early (the gate asks this policy's `forecast`); one that
states none has nothing to be measured against, and the cache-aware choice, the defaults'
measured hit ratio near its oracle, stays what it gets.

One prefix tree serves both kinds: `slo` is `cache_aware` underneath, so where the joint
choice sent a prompt is where the next turn of that conversation looks for its prefix, with
or without objectives.

Prefill role: `pick_pair` answers only for a request with objectives (the scheduler then does
not ask the decode policy); for the rest it declines and `pick` is `cache_aware`'s. Decode role
(`--policy auto`, or a pick outside the joint path, such as a session's): with objectives,
`slo`'s decode choice (decode protection); without, `least_load`'s.

Options are `slo`'s (which include `cache_aware`'s). Those given under `cache_aware` (prefill)
or `least_load` (decode), then `slo`, apply to it too, its own under `auto` last: a
configuration written for the old defaults keeps its meaning (`inherited_options`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from gateway.policies.cache_aware import CacheAwarePolicy
from gateway.policies.least_load import LeastLoadOptions, LeastLoadPolicy
from gateway.policies.slo import SloOptions, SloPolicy
from gateway.request import RequestView
from gateway.scheduling.load import LoadOptions
from gateway.servers.pool import Server


def has_objectives(view: RequestView) -> bool:
    """Whether the request states a TTFT or ITL objective (its headers or its class's)."""
    ticket = view.slo
    return ticket is not None and ticket.objective.any


@dataclass(frozen=True)
class AutoOptions(SloOptions):
    """`slo`'s options; the prefill stays the cache-aware choice unless `steer` is set (the
    forecasts then choose the decode, feed the gate and learn)."""

    steer: bool = False


class AutoPolicy(SloPolicy):
    name = "auto"
    Options = AutoOptions
    learns_from_every_request = False  # the joint choice only for a request with objectives

    def __init__(self, role: str, options=None) -> None:
        super().__init__(role, options)
        # the decode role without objectives: least_load itself, on the shared load options,
        # with its own rotation apart from the joint choice's
        load = {f.name: getattr(self.options, f.name) for f in fields(LoadOptions)}
        self._least = LeastLoadPolicy(role, LeastLoadOptions(**load))

    @classmethod
    def inherited_options(cls, role: str) -> tuple[str, ...]:
        return ("cache_aware" if role == "prefill" else "least_load", "slo")

    def pick_pair(self, prefills: Sequence, decodes: Sequence[Server], view: RequestView,
                  blocked: Callable[[str, str], bool]) -> tuple | None:
        if not has_objectives(view):
            return None  # cache_aware's `pick`, then the decode policy
        return super().pick_pair(prefills, decodes, view, blocked)

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        if self.role != "decode":  # cache_aware's choice (slo's `pick` would pass it on)
            return CacheAwarePolicy.pick(self, candidates, view)
        if has_objectives(view):
            return super().pick(candidates, view)  # slo's decode choice
        return self._least.pick(candidates, view)
