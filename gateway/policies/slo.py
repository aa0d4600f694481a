"""slo: choose the (prefill target, decode) pair jointly by predicted latency against the
request's objectives (gateway/slo/, docs/SCHEDULING.md).

The cache-aware choice stays the anchor (this policy is `cache_aware` underneath: its tree,
ring placement, capacity test and `--workers` sharing), because where a prompt's prefix
lives decides most of its TTFT and the hit ratio of that choice is near its oracle. The
latency model (gateway/slo/model.py) then prices every candidate:

    ttft(t, d) = wait(t) + compute(t, uncached part) + transfer(t -> d) + admit(d)
    itl(d)     = decode step at d's batch and context with this request added

and moves the request off the anchor only when that pays: when the anchor's pair cannot meet
the request's TTFT objective and another can, or (no objective) when work is queued at the
anchor and another target's predicted TTFT, its recompute of the prefix included, is
`move_factor` times lower. A hot
prefix is thus copied to a second target exactly when the queue on its holder outgrows a
recompute elsewhere, and comes back as the queue drains.

Decodes: a decode whose predicted ITL would exceed the tightest ITL objective of its running
requests, or this request's own, is left out while another decode is not (decode
protection); of the rest, the lowest predicted TTFT plus the request's output budget at the
predicted ITL.

Cost: the prefix match once, each candidate's part once (O(prefills + decodes)), then only
the best `top_k` prefills (the anchor always among them) by their own part times the best
`top_k` decodes are paired (loadtests/slo_pick.py measures it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.policies.cache_aware import CacheAwareOptions, CacheAwarePolicy
from gateway.request import RequestView
from gateway.scheduling.load import rotating_argmin
from gateway.servers.pool import Server
from gateway.slo.model import LatencyModel, Prediction
from gateway.tokens.context_check import requested_new_tokens


def near_turn(costs: Sequence[float], tie: float, turn: int) -> int:
    """Index of the lowest cost; costs within `tie` seconds and `NEAR` of it are ties,
    taken in turn: a quantized cost would split near-equal servers at a rounding edge, and
    learned factors differ by their noise, so an idle fleet's sequential requests would all
    go to the server that happened to measure a little faster."""
    low = min(costs)
    bound = low * (1.0 + NEAR) + tie
    return rotating_argmin([0.0 if c <= bound else 1.0 for c in costs], turn)


NEAR = 0.1  # forecasts within 10% are ties (about the noise of a learned factor)
OUTPUT_GUESS = 128  # output tokens of a request that sets no budget (weighs its ITL)
INF = float("inf")


@dataclass(frozen=True)
class SloOptions(CacheAwareOptions):
    """The cache-aware options, plus the joint choice's pruning and tie rules."""

    top_k: int = 4  # prefills and decodes paired per pick (the anchor always included)
    min_match: float = 0.1  # a shorter match is noise, not a cache hit worth pricing
    tie_seconds: float = 0.005  # forecasts closer than this are ties (broken in turn)
    # move a request off the cache-aware choice when a forecast says so (the two moves of
    # `_decide`); off: the anchor's prefill always, the forecasts choose only its decode and
    # feed the gate (`auto`'s default: docs/SCHEDULING.md)
    steer: bool = True

    def validate(self) -> None:
        super().validate()
        if self.top_k < 1:
            raise ValueError(f"option 'top_k' must be >= 1, got {self.top_k}")
        if not 0.0 <= self.min_match <= 1.0:
            raise ValueError(f"option 'min_match' must be in [0, 1], got {self.min_match}")
        if self.tie_seconds < 0:
            raise ValueError(f"option 'tie_seconds' must be >= 0, got {self.tie_seconds}")


class SloPolicy(CacheAwarePolicy):
    name = "slo"
    Options = SloOptions
    learns_from_every_request = True

    def __init__(self, role: str, options: SloOptions | None = None) -> None:
        super().__init__(role, options)
        self.model = LatencyModel()
        self._moves = {"anchor": 0, "faster": 0, "objective": 0, "protected": 0}

    # -- the joint hook (gateway/scheduling/scheduler.py) ------------------------------------

    def pick_pair(self, prefills: Sequence, decodes: Sequence[Server], view: RequestView,
                  blocked: Callable[[str, str], bool]) -> tuple:
        """The (prefill target, decode) pair for `view`; its forecast goes on the request's
        SLO ticket (`view.slo`), where the gate later compares it with what happened."""
        key = view.routing_key
        matched = self.match(key, prefills)
        anchor = prefills.index(self.choose(prefills, matched, len(key), key))
        now = time.monotonic()
        pairs = self._pairs(prefills, decodes, view, matched, anchor, now, blocked)
        target, decode, forecast = self._decide(pairs, prefills[anchor], view)
        ticket = view.slo
        if ticket is not None:
            ticket.picked(self.model, target.url, decode.url, forecast, time.perf_counter())
        return target, decode

    def forecast(self, prefills: Sequence, decodes: Sequence[Server], view: RequestView,
                 blocked: Callable[[str, str], bool] | None = None) -> Prediction | None:
        """The best forecast any pair offers `view` now (no state changes): what the SLO
        gate tests the request's objective against. `blocked` is `pick_pair`'s: a pair the
        pick will not use (a prefill that just refused connections, not yet marked down)
        must not lend the gate its empty queue."""
        key = view.routing_key
        matched = self.match(key, prefills)
        pairs = self._pairs(prefills, decodes, view, matched, None, time.monotonic(), blocked)
        return min((p[2] for p in pairs), key=lambda p: p.ttft, default=None)

    # -- pricing -------------------------------------------------------------------------------

    def _cached(self, url: str, matched, key_len: int, prompt: int) -> float:
        share = matched.get(url, 0) / key_len if key_len else 0.0
        return prompt * share if share >= self.options.min_match else 0.0

    def _pairs(self, prefills: Sequence, decodes: Sequence[Server], view: RequestView,
               matched, anchor: int | None, now: float,
               blocked: Callable[[str, str], bool] | None) -> list[tuple]:
        """(target, decode, forecast) of the pruned candidate pairs."""
        model, k = self.model, self.options.top_k
        prompt, key_len = view.prompt_tokens, len(view.routing_key)
        parts = []
        for i, target in enumerate(prefills):
            cached = self._cached(target.url, matched, key_len, prompt)
            wait, compute = model.prefill_part(target, prompt - cached, cached, now)
            parts.append((wait + compute, i, wait, compute))
        chosen = sorted(parts)[:k]
        if anchor is not None and all(p[1] != anchor for p in chosen):
            chosen.append(next(p for p in parts if p[1] == anchor))
        sides = self._decodes(decodes, view, now)
        transfer = model.transfer(prompt)
        pairs = []
        for _, i, wait, compute in chosen:
            target = prefills[i]
            for admit, step, decode in sides:
                if blocked is not None and blocked(target.server.url, decode.url):
                    continue
                pairs.append((target, decode, model.combine(
                    target.url, decode.url, wait, compute, transfer, admit, step,
                    model.measured(target))))
        if not pairs and blocked is not None:  # all quarantined: as the scheduler, any
            return self._pairs(prefills, decodes, view, matched, anchor, now, None)
        return pairs

    def _decodes(self, decodes: Sequence[Server], view: RequestView,
                 now: float) -> list[tuple[float, float, Server]]:
        """(admit, step, decode) of the best `top_k` decodes that protection allows."""
        model = self.model
        own = view.slo.objective.itl if view.slo is not None else None
        priced, safe = [], []
        for decode in decodes:
            admit, step = model.decode_part(decode, view.prompt_tokens, now)
            itl = model.itl(decode.url, step)
            bound = model.tightest(decode.url)
            if own is not None:
                bound = own if bound is None else min(bound, own)
            entry = (admit, step, decode)
            priced.append(entry)
            if bound is None or itl <= bound:
                safe.append(entry)
        if safe and len(safe) < len(priced):
            self._moves["protected"] += 1
        pool = safe or priced
        return sorted(pool, key=lambda e: e[0] + e[1])[:self.options.top_k]

    # -- deciding ------------------------------------------------------------------------------

    def _decide(self, pairs: list[tuple], anchor, view: RequestView) -> tuple:
        """The pair to send `view` to (the rules in the module docstring)."""
        out = requested_new_tokens(view) or OUTPUT_GUESS
        tie = self.options.tie_seconds or 1e-9
        turn = self._turn

        def best(options: list[tuple]) -> tuple:
            costs = [p[2].ttft + out * p[2].itl for p in options]
            return options[near_turn(costs, tie, turn)]

        own = [p for p in pairs if p[0] is anchor]
        home = best(own or pairs)
        if not self.options.steer:
            self._moves["anchor"] += 1
            return home
        objective = view.slo.objective.ttft if view.slo is not None else None
        if objective is not None and home[2].ttft > objective:
            meeting = [p for p in pairs if p[2].ttft <= objective]
            if meeting:
                self._moves["objective"] += 1
                return best(meeting)
        fastest = min(pairs, key=lambda p: p[2].ttft)
        # only a queue at the anchor is worth a move: with none, what separates forecasts is
        # the servers' learned pace, and following it would undo the anchor's load spreading
        if fastest[0] is not anchor and home[2].wait > 0 and \
                home[2].ttft > fastest[2].ttft * self.options.move_factor + tie:
            self._moves["faster"] += 1
            return best([p for p in pairs if p[0] is fastest[0]])
        self._moves["anchor"] += 1
        return home

    # -- the decode role, and the figures ------------------------------------------------------

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        if self.role != "decode":
            return super().pick(candidates, view)
        turn = self._turn
        self._turn += 1
        sides = self._decodes(candidates, view, time.monotonic())
        return sides[near_turn([a + s for a, s, _ in sides], self.options.tie_seconds,
                               turn)][2]

    def on_dispatch(self, server: Server, view: RequestView) -> None:
        if self.role != "decode":  # what a decode holds is what its prefill sent it
            super().on_dispatch(server, view)

    def on_servers_changed(self, servers: Sequence[Server]) -> None:
        super().on_servers_changed(servers)
        if self.role != "decode":  # the targets: servers, or their DP ranks
            self.model.forget_targets({w.url for w in servers})

    def stats(self) -> dict:
        return {**super().stats(), "moves": dict(self._moves), "model": self.model.factors()}
