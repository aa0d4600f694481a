"""The request loop: pick a pair, dispatch, account, and retry safely.

A retry happens only before anything reached the client (the dispatcher returns a stream
only after its first chunk), only for failures another pair may not have (connect errors,
timeouts, 408/429/5xx), with a new pair and new rooms, capped exponential backoff with
jitter, and within the request's total deadline.
"""

from __future__ import annotations

import asyncio
import random
import time

from gateway.dispatch.aborts import Aborted
from gateway.dispatch.failover import Continuation, error_end, resumable
from gateway.dispatch.inflight import Tracked
from gateway.dispatch.pd import REQUEST_TIMEOUT, Answer, Attempt, PDDispatcher
from gateway.dispatch.relay import Capture, StreamBroken
from gateway.errors import GatewayError, UpstreamError
from gateway.observability.answer_tokens import prompt_usage
from gateway.observability.metrics import Metrics
from gateway.request import RequestView
from gateway.scheduling.scheduler import Scheduler
from gateway.servers.pool import Server


class Proxy:
    def __init__(self, scheduler: Scheduler, dispatcher: PDDispatcher, metrics: Metrics,
                 max_attempts: int, backoff: float, backoff_max: float,
                 request_timeout: float, failover: bool = True) -> None:
        self.scheduler = scheduler
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.request_timeout = request_timeout
        self.failover = failover

    async def handle(self, view: RequestView, tracked: Tracked, placement=None,
                     depth: int = 0, avoid: tuple[Server, ...] = ()) -> Answer:
        """Serve one PD request; `placement` (parallel sampling) lets the samples of one
        request follow the first to its prefill server; `depth` counts continuations of a
        broken stream, `avoid` the servers it should not go to first."""
        avoid = list(avoid)
        last_error: GatewayError | None = None
        loop = self.dispatcher.timers.loop()
        not_after = loop.time() + self.request_timeout  # each attempt's deadline is capped
        trace = tracked.trace  # tracing.RequestTrace, or None (tracing off)
        if tracked.not_after is not None and tracked.not_after < not_after:
            not_after = tracked.not_after  # the client's own deadline (gateway/admission/tenancy.py)
        try:
            for number in range(1, self.max_attempts + 1):
                if tracked.aborted:
                    raise Aborted(f"request {tracked.request_id} was aborted")
                prefer = placement.prefer if placement is not None else None
                picking = time.time_ns() if trace is not None else 0
                target, decode = self.scheduler.pick(view, avoid, prefer)
                prefill = target.server
                attempt = self.dispatcher.prepare(view, prefill, decode, tracked,
                                                  target.rank)
                if trace is not None:
                    attempt.trace = trace.picked(attempt, number - 1, depth, picking)
                attempt.not_after = not_after
                if placement is not None:
                    placement.started(attempt)
                attempt.resumable = (self.failover and depth < Resumed.MAX_DEPTH
                                     and resumable(view))
                if attempt.resumable:
                    Resumed(self, view, tracked, attempt, depth)
                self._started(attempt, self.scheduler.by_policy(view, target, prefer))
                tracked.attempts.add(attempt)
                try:
                    answer = await self.dispatcher.run(attempt)  # stays in `attempts`
                    return answer
                except BaseException as exc:
                    tracked.attempts.discard(attempt)
                    if not isinstance(exc, UpstreamError):
                        raise
                    if trace is not None:
                        trace.failed(exc, number - 1)
                    last_error = exc
                    if not exc.retryable or number == self.max_attempts:
                        raise
                    # both servers are avoided (softly: the scheduler ignores `avoid`
                    # when it would leave no candidate): which one failed is not always
                    # the leg that reported it (a prefill's "bootstrap failed" means its
                    # decode never came for the KV)
                    avoid += (prefill, decode)
                    self.metrics.retries.labels(exc.leg, _reason(exc)).inc()
                    if tracked.usage is not None:
                        tracked.usage.retries += 1
                    delay = min(self.backoff_max, self.backoff * 2 ** (number - 1))
                    delay *= 0.5 + random.random() / 2
                    if loop.time() + delay >= not_after:
                        raise self._out_of_time(last_error) from None
                    await asyncio.sleep(delay)
        except UpstreamError as exc:
            if exc.reason == REQUEST_TIMEOUT:
                raise self._out_of_time(last_error) from None
            raise
        raise AssertionError("unreachable")  # the loop returns or raises

    def _out_of_time(self, last_error: GatewayError | None) -> GatewayError:
        detail = f"; last failure: {last_error.message}" if last_error else ""
        return GatewayError(f"request did not complete within {self.request_timeout:g}s{detail}",
                            status=504)

    def _started(self, attempt: Attempt, by_policy: bool) -> None:
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
        """Called once per leg by the dispatcher: release counters, feed breaker and policy.
        A failure that is the pair's own (both servers work with other partners) feeds the
        pair's health instead of the servers' breakers."""
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
            self.dispatcher.rescue(server, "opened its circuit breaker")
        if not prefill:
            attempt.settle(server)
        elif attempt.trailing:  # settled at first progress (pd.progress), the server's now
            attempt.end_trail()
        elif not attempt.progressed:
            attempt.settle_prefill()
        if target is not server:  # the prefill's DP rank
            target.finish(tokens)
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
                attempt.pair_verdict = "pair" if pairs.record_failure(p_url, d_url) else "server"
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


class Resumed:
    """A stream that survives its decode: when it breaks, the rest of the answer comes from a
    new pair (gateway/dispatch/failover.py), spliced into what the client already has. The relay keeps
    what was sent (`attempt.capture`) and, once the broken stream is cleaned up, goes on with
    `continue_after` (`attempt.on_broken`): no generator layer of its own on the way. The
    continuation is itself resumable, up to MAX_DEPTH continuations of one stream."""

    MAX_DEPTH = 3

    def __init__(self, proxy: Proxy, view: RequestView, tracked: Tracked, attempt: Attempt,
                 depth: int) -> None:
        self.proxy = proxy
        self.view = view
        self.tracked = tracked
        self.depth = depth
        self.seen = attempt.capture = Capture()
        attempt.on_broken = self.continue_after
        self.failovers = proxy.metrics.failovers

    async def continue_after(self, broken: StreamBroken):
        view = self.view
        error = broken.error
        cont = Continuation.build(view, self.seen.objects()) if self.seen.usable else None
        if cont is None:
            self.failovers.labels(view.endpoint, "not_resumable").inc()
            yield error_end(error)
            return
        if cont.view is None:  # the answer was complete; only its [DONE] was missing
            yield cont.closing()
            return
        try:
            nxt = await self.proxy.handle(cont.view, self.tracked, depth=self.depth + 1,
                                          avoid=(broken.decode,))
        except GatewayError as exc:
            self.failovers.labels(view.endpoint, "failed").inc()
            yield error_end(exc)
            return
        self.failovers.labels(view.endpoint, "continued").inc()
        if self.tracked.usage is not None:
            self.tracked.usage.failovers += 1
        try:
            async for chunk in cont.splice(nxt.stream):
                yield chunk
        finally:
            if nxt.close is not None:
                await nxt.close()


def _reason(exc: UpstreamError) -> str:
    if exc.reason is not None:
        return exc.reason
    if exc.upstream_status is not None:
        return str(exc.upstream_status)
    return "timeout" if exc.status == 504 else "connection"
