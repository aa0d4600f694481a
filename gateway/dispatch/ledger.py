"""What an attempt takes from its servers, policies and metrics, and gives back per leg.

`opened` takes the counters once per attempt (both servers, the prefill's DP rank, the
policies' dispatch hooks); `leg_done` gives them back once per leg, however the leg ended:
counters released, the breaker fed (or the pair's health, when the failure is the pair's
own), the load snapshot settled, the policy's completion hook, failure metrics and the trace.
The dispatcher calls it from the one place each leg ends (gateway/dispatch/pd.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.dispatch import rescue
from gateway.dispatch.attempt import Attempt
from gateway.observability.answer_tokens import prompt_usage
from gateway.observability.metrics import Metrics
from gateway.servers.pool import Server

if TYPE_CHECKING:
    from gateway.scheduling.scheduler import Scheduler


class Ledger:
    def __init__(self, scheduler: Scheduler, metrics: Metrics,
                 peers: Callable[[str], list[Server]] | None = None) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        # the servers of a role: a breaker that opens stops its attempts only if a retry can
        # go elsewhere (rescue.rescue); None: it always stops them
        self.peers = peers

    def rescue(self, server: Server, why: str) -> int:
        """Stop the attempts on `server` (down, breaker open) if a retry can go elsewhere."""
        return rescue.rescue(server, f"{server.role} server {server.url} {why}",
                             self.peers_of(server.role))

    def peers_of(self, role: str) -> list[Server] | None:
        """The servers of `role` a retry could go to; None: not known."""
        return None if self.peers is None else self.peers(role)

    def opened(self, attempt: Attempt, by_policy: bool) -> None:
        """The attempt is sent: count it on both servers and tell the policies."""
        m = self.metrics
        view = attempt.view
        tokens = view.prompt_tokens
        target, decode = attempt.prefill_target, attempt.decode
        # the model's own policies, looked up once per attempt: the hooks go back to them
        policies = attempt.policies = self.scheduler.policies_of(attempt.prefill)
        chooser, decider = policies["prefill"], policies["decode"]
        predicted = chooser.predicted_hit(target, view) \
            if by_policy else None  # not for a session's or a sample's own choice
        # the prefill's load is what it must compute: a cached prefix costs it little
        prefill_tokens = attempt.prefill_tokens = \
            tokens - round(predicted * tokens) if predicted else tokens
        attempt.dispatched_at = time.monotonic()
        attempt.prefill.start(prefill_tokens)
        if target is not attempt.prefill:
            target.start(prefill_tokens)
            m.child(attempt.prefill, m.rank_requests, str(target.rank), url_first=True).pending += 1
        decode.start(tokens)
        chooser.on_dispatch(target, view)  # each policy looked up once per attempt
        decider.on_dispatch(decode, view)
        if predicted:
            m.child(attempt.prefill, m.predicted_tokens).pending += predicted * tokens
        m.child(attempt.prefill, m.decisions, "prefill", chooser.name).pending += 1
        m.child(decode, m.decisions, "decode", decider.name).pending += 1
        if attempt.tracked.usage is not None:
            attempt.tracked.usage.dispatched(attempt)

    def leg_done(self, attempt: Attempt, leg: str, ok: bool | None) -> None:
        """Once per leg (later calls do nothing): release counters, feed breaker and policy.
        A failure that is the pair's own (both servers work with other partners) feeds the
        pair's health instead of the servers' breakers."""
        if leg in attempt.outcome:
            return
        attempt.outcome[leg] = ok
        if attempt.trace is not None:
            attempt.trace.leg_done(leg, ok)
        prefill = leg == "prefill"
        if ok is True:
            if not prefill:
                self.scheduler.pairs.record_success(attempt.prefill.url, attempt.decode.url)
        else:
            ok = self._pair_outcome(attempt, prefill, ok)
        if prefill:
            server, tokens, target = attempt.prefill, attempt.prefill_tokens, \
                attempt.prefill_target
        else:
            server, tokens = attempt.decode, attempt.view.prompt_tokens
            target = server
        if server.finish(tokens, ok):
            self.rescue(server, "opened its circuit breaker")
        if not prefill:
            attempt.settle(server)
        elif attempt.trailing:  # settled at first progress (pd.progress), the server's now
            attempt.end_trail()
        elif not attempt.progressed:
            attempt.settle_prefill()
        if prefill:  # its DP rank, unless released at first progress
            attempt.release_rank()
        attempt.policies[leg].on_complete(target, attempt.view, ok is True)
        if ok is False:
            self.metrics.child(server, self.metrics.leg_failures, leg, "error",
                               url_first=True).inc()
        if prefill and attempt.tracked.usage is not None:
            attempt.tracked.usage.prefill_settled()

    def _pair_outcome(self, attempt: Attempt, prefill: bool, ok: bool | None) -> bool | None:
        """A leg that failed (False) or ended without a verdict (None), told to the pair's
        health; None when the failure is the pair's own, not its servers'."""
        pairs = self.scheduler.pairs
        p_url, d_url = attempt.prefill.url, attempt.decode.url
        if ok is False:
            if attempt.pair_verdict is None:
                booked = pairs.record_failure(p_url, d_url, (attempt.prefill, attempt.decode))
                attempt.pair_verdict = "pair" if booked else "server"
            if attempt.pair_verdict == "pair":
                self.metrics.child(attempt.prefill, self.metrics.pair_failures, d_url,
                                   url_first=True).inc()
                return None
        elif not prefill and attempt.pair_verdict is None:
            pairs.release_probe(p_url, d_url)
        return ok

    def prefill_answered(self, attempt: Attempt, body: bytes) -> None:
        """Count prompt and cached tokens the prefill reports (its cache is the one that
        matters for time to first token)."""
        prompt, cached = prompt_usage(body)
        if prompt:
            self.metrics.child(attempt.prefill, self.metrics.prompt_tokens).pending += prompt
            self.metrics.child(attempt.prefill, self.metrics.cached_tokens).pending += cached
            if attempt.tracked.usage is not None:  # the tenant's share of the same figures
                attempt.tracked.usage.prefill_reported(prompt, cached)
