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

import orjson

from gateway.aborts import Aborted
from gateway.errors import GatewayError, UpstreamError
from gateway.failover import Continuation, error_end, resumable
from gateway.inflight import Tracked
from gateway.metrics import Metrics
from gateway.pd import REQUEST_TIMEOUT, Answer, Attempt, PDDispatcher
from gateway.relay import Capture, StreamBroken
from gateway.request import RequestView
from gateway.scheduler import Scheduler
from gateway.sse import data_objects
from gateway.workers import Worker


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
                     depth: int = 0, avoid: tuple[Worker, ...] = ()) -> Answer:
        """Serve one PD request; `placement` (parallel sampling) lets the samples of one
        request follow the first to its prefill server; `depth` counts continuations of a
        broken stream, `avoid` the servers it should not go to first."""
        avoid = list(avoid)
        last_error: GatewayError | None = None
        loop = asyncio.get_running_loop()
        not_after = loop.time() + self.request_timeout  # each attempt's deadline is capped
        trace = tracked.trace  # tracing.RequestTrace, or None (tracing off)
        if tracked.not_after is not None and tracked.not_after < not_after:
            not_after = tracked.not_after  # the client's own deadline (gateway/tenancy.py)
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
        tokens = attempt.view.prompt_tokens
        target = attempt.prefill_target
        chooser = self.scheduler.policy("prefill", target)  # the model's own policy
        predicted = chooser.predicted_hit(target, attempt.view) \
            if by_policy else None  # not for a session's or a sample's own choice
        # the prefill's load is what it must compute: a cached prefix costs it little
        attempt.prefill_tokens = tokens - round((predicted or 0.0) * tokens)
        attempt.dispatched_at = time.monotonic()
        attempt.prefill.start(attempt.prefill_tokens)
        if target is not attempt.prefill:
            target.start(attempt.prefill_tokens)
            m.child(attempt.prefill, m.rank_requests, str(target.rank), url_first=True).inc()
        attempt.decode.start(tokens)
        self.scheduler.dispatched(target, attempt.decode, attempt.view)
        if predicted:
            m.child(attempt.prefill, m.predicted_tokens).inc(predicted * tokens)
        m.child(attempt.prefill, m.decisions, "prefill", chooser.name).inc()
        m.child(attempt.decode, m.decisions, "decode",
                self.scheduler.policy("decode", attempt.decode).name).inc()
        if attempt.tracked.usage is not None:
            attempt.tracked.usage.dispatched(attempt)

    def leg_done(self, attempt: Attempt, leg: str, ok: bool | None) -> None:
        """Called once per leg by the dispatcher: release counters, feed breaker and policy.
        A failure that is the pair's own (both servers work with other partners) feeds the
        pair's health instead of the servers' breakers."""
        pairs = self.scheduler.pairs
        p_url, d_url = attempt.prefill.url, attempt.decode.url
        if ok is False:
            if attempt.pair_verdict is None:
                attempt.pair_verdict = "pair" if pairs.record_failure(p_url, d_url) else "server"
            if attempt.pair_verdict == "pair":
                ok = None
                self.metrics.child(attempt.prefill, self.metrics.pair_failures, d_url,
                                   url_first=True).inc()
        elif ok is True and leg == "decode":
            pairs.record_success(p_url, d_url)
        elif ok is None and leg == "decode" and attempt.pair_verdict is None:
            pairs.release_probe(p_url, d_url)
        worker = attempt.prefill if leg == "prefill" else attempt.decode
        tokens = attempt.prefill_tokens if leg == "prefill" else attempt.view.prompt_tokens
        if worker.finish(tokens, ok):
            self.dispatcher.rescue(worker, "opened its circuit breaker")
        if leg == "decode":
            attempt.settle(worker)
        elif not attempt.progressed:  # else settled at first progress (pd.progress)
            attempt.settle_prefill()
        target = worker
        if leg == "prefill" and attempt.prefill_target is not worker:
            target = attempt.prefill_target
            target.finish(tokens)
        self.scheduler.completed(leg, target, attempt.view, ok is True)
        if ok is False:
            self.metrics.child(worker, self.metrics.leg_failures, leg, "error",
                               url_first=True).inc()
        if leg == "prefill" and attempt.tracked.usage is not None:
            attempt.tracked.usage.prefill_settled()

    def prefill_answered(self, attempt: Attempt, body: bytes) -> None:
        """Count prompt and cached tokens the prefill reports (its cache is the one that
        matters for time to first token)."""
        prompt, cached = usage_of(body)
        if prompt:
            self.metrics.child(attempt.prefill, self.metrics.prompt_tokens).inc(prompt)
            self.metrics.child(attempt.prefill, self.metrics.cached_tokens).inc(cached)
            if attempt.tracked.usage is not None:  # the tenant's share of the same figures
                attempt.tracked.usage.prefill_reported(prompt, cached)


class Resumed:
    """A stream that survives its decode: when it breaks, the rest of the answer comes from a
    new pair (gateway/failover.py), spliced into what the client already has. The relay keeps
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


def usage_of(body: bytes) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) from a native or OpenAI answer, summed over items."""
    try:
        items = data_objects(body) if body.lstrip()[:5] == b"data:" else orjson.loads(body)
    except orjson.JSONDecodeError:
        return 0, 0
    if isinstance(items, dict):
        items = [items]
    prompt = cached = 0
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        meta = item.get("meta_info")
        if isinstance(meta, dict):
            prompt += meta.get("prompt_tokens") or 0
            cached += meta.get("cached_tokens") or 0
            continue
        usage = item.get("usage")
        if isinstance(usage, dict):
            prompt += usage.get("prompt_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            cached += details.get("cached_tokens") or 0
    return prompt, cached
