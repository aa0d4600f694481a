"""The request loop: pick a pair, dispatch, account, and retry safely.

A retry happens only before anything reached the client (the dispatcher returns a stream
only after its first whole event), only for failures another pair may not have (connect
errors, timeouts, 408/429/5xx, broken answers), with a new pair and new rooms, capped
exponential backoff with jitter, and within the request's total deadline. `--max-attempts`
counts the attempts that failed on their servers; an attempt the gateway stopped itself to
move it elsewhere (a rescue: its server was marked down, opened its breaker, or its pair is
suspected hung) and one whose server refused the connection do not count, up to twice
`--max-attempts` attempts in all. A retry of a request with a TTFT objective passes the SLO
gate again (`readmit`): a server lost under load sends its queue to the others at once, and
those retries, let through, would queue everything behind them past its objective (the work
of a dead prefill's queue landing on one survivor held interactive requests 12 s); so a retry
that cannot make what is left of its objective waits or is refused as a new request would
be. The retry avoids the server the evidence blames
(gateway/dispatch/blame.py), and the samples of an n > 1 request share what they learned
(`Shared`; docs/RELIABILITY.md, "Rolling faults").
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

from gateway.dispatch.aborts import Aborted
from gateway.dispatch.blame import culprits
from gateway.dispatch.failover import Continuation, error_end, resumable
from gateway.dispatch.inflight import Tracked
from gateway.dispatch.pd import REQUEST_TIMEOUT, Answer, Attempt, PDDispatcher
from gateway.dispatch.relay import Capture, StreamBroken
from gateway.dispatch.rescue import RESCUED
from gateway.errors import GatewayError, UpstreamError
from gateway.observability.metrics import Metrics
from gateway.request import RequestView
from gateway.scheduling.scheduler import Scheduler
from gateway.servers.pool import Server
from gateway.upstream.client import REFUSED

# failures that do not spend an attempt: the gateway stopped it to move it (a rescue), or
# the server refused the connection (nothing was sent, nothing computed)
FREE = frozenset({RESCUED, REFUSED})
ROLLING = 5.0  # seconds: another server's success this recent means faults roll, not a dead role


class Proxy:
    def __init__(self, scheduler: Scheduler, dispatcher: PDDispatcher, metrics: Metrics,
                 max_attempts: int, backoff: float, backoff_max: float,
                 request_timeout: float, failover: bool = True,
                 readmit: Callable[[RequestView], Awaitable[None]] | None = None) -> None:
        self.scheduler = scheduler
        self.readmit = readmit  # the SLO gate's admission, for a retry (SloGate.admit)
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.request_timeout = request_timeout
        self.failover = failover
        # an attempt that failed after this long lowers the floor of the next ones' deadlines
        self.urgent_after = dispatcher.model.least_floor()

    async def handle(self, view: RequestView, tracked: Tracked, placement=None,
                     depth: int = 0, avoid: tuple[Server, ...] = ()) -> Answer:
        """Serve one PD request; `placement` (parallel sampling) lets the samples of one
        request follow the first to its prefill server; `depth` counts continuations of a
        broken stream, `avoid` the servers it should not go to first."""
        # what the attempts learned; made at the first failure unless a sampling placement
        # shares one (most requests never fail: no object, no calls)
        shared = placement.shared if placement is not None else Shared() if avoid else None
        if avoid:
            shared.blame(avoid)
        last_error: GatewayError | None = None
        loop = self.dispatcher.timers.loop()
        not_after = loop.time() + self.request_timeout  # each attempt's deadline is capped
        if tracked.not_after is not None and tracked.not_after < not_after:
            not_after = tracked.not_after  # the client's own deadline (admission/tenancy.py)
        failed = 0  # attempts that failed on servers that looked sound when picked
        try:
            for number in range(1, 2 * self.max_attempts + 1):
                avoiding = shared.avoiding() if shared is not None else []
                attempt, by_policy = self._attempt(view, tracked, placement, depth, avoiding,
                                                   number)
                doubtful = _doubtful(attempt, shared.tried if shared is not None else ())
                attempt.not_after = not_after
                tracked.attempts.add(attempt)
                try:
                    answer = await self.dispatcher.run(attempt, by_policy)
                    if shared is not None:
                        shared.served = True  # (the attempt stays in `attempts`)
                    return answer
                except BaseException as exc:
                    tracked.attempts.discard(attempt)
                    if not isinstance(exc, UpstreamError):
                        raise
                    if tracked.trace is not None:
                        tracked.trace.failed(exc, number - 1)
                    last_error = exc
                    if loop.time() - attempt.started_at >= self.urgent_after:
                        tracked.silences += 1  # it waited: the next deadlines are shorter
                    spent = self._spends(exc, attempt, doubtful)
                    failed += spent
                    if not exc.retryable or failed == self.max_attempts \
                            or number == 2 * self.max_attempts:
                        raise
                    if shared is None:
                        shared = Shared()
                    shared.failed(attempt, exc)
                    delay = self._retrying(exc, tracked, number, hold=not spent
                                           and exc.reason not in FREE and not shared.served)
                    if loop.time() + delay >= not_after:
                        raise self._out_of_time(last_error) from None
                    await asyncio.sleep(delay)
                    if self.readmit is not None and placement is None and depth == 0 \
                            and view.slo is not None:
                        await self.readmit(view)  # queues, or raises 429/503: nothing sent
        except UpstreamError as exc:
            if exc.reason == REQUEST_TIMEOUT:
                raise self._out_of_time(last_error) from None
            raise
        raise AssertionError("unreachable")  # the loop returns or raises

    def _attempt(self, view: RequestView, tracked: Tracked, placement, depth: int,
                 avoid: list[Server], number: int) -> tuple[Attempt, bool]:
        """The pair for attempt `number` and the attempt on it; whether the policy chose it."""
        if tracked.aborted:
            raise Aborted(f"request {tracked.request_id} was aborted")
        trace = tracked.trace  # tracing.RequestTrace, or None (tracing off)
        prefer = placement.prefer if placement is not None else None
        picking = time.time_ns() if trace is not None else 0
        target, decode = self.scheduler.pick(view, avoid, prefer)
        attempt = self.dispatcher.prepare(view, target.server, decode, tracked, target.rank)
        attempt.urgency = tracked.silences
        if trace is not None:
            attempt.trace = trace.picked(attempt, number - 1, depth, picking)
        if placement is not None:
            placement.started(attempt)
        attempt.resumable = (self.failover and depth < Resumed.MAX_DEPTH
                             and resumable(view))
        if attempt.resumable:
            Resumed(self, view, tracked, attempt, depth)
        return attempt, self.scheduler.by_policy(view, target, prefer)

    def _spends(self, exc: UpstreamError, attempt: Attempt, doubtful: bool) -> bool:
        """Whether a failed attempt spends one of `--max-attempts`. Not a rescue nor a
        refused connection (`FREE`), nor a quick failure of a doubtful pair while another
        server of the failing leg's role served a request in the last `ROLLING` seconds:
        faults then roll over the servers of a role, each failing a request in turn, and the
        budget would be gone in a second while each server recovers within seconds; such
        attempts wait `backoff_max` between them and stay within the cap of twice
        `--max-attempts` in all. A timeout always spends one (it cost the client the whole
        deadline), and so does a failure while no other server of the role serves (a role
        that is broken as a whole fails fast)."""
        if exc.reason in FREE:
            return False
        if not doubtful or exc.status == 504 or exc.leg not in ("prefill", "decode"):
            return True
        since = time.monotonic() - ROLLING
        return not any(w.last_success > since for w in self.scheduler.pool.role(exc.leg)
                       if w is not attempt.prefill and w is not attempt.decode)

    def _retrying(self, exc: UpstreamError, tracked: Tracked, number: int,
                  hold: bool) -> float:
        """Count the retry and return its delay: capped exponential backoff with jitter; after
        a doubtful pair's quick failure that spent nothing (`hold`: faults roll) at least
        `backoff_max`, so that the next pick comes after the health checks had time to find a
        server recovered, instead of trying the same broken servers again at once."""
        self.metrics.retries.labels(exc.leg, _reason(exc)).inc()
        if tracked.usage is not None:
            tracked.usage.retries += 1
        delay = min(self.backoff_max, self.backoff * 2 ** (number - 1))
        if hold:
            delay = max(delay, self.backoff_max)
        return delay * (0.5 + random.random() / 2)

    def _out_of_time(self, last_error: GatewayError | None) -> GatewayError:
        said = f"request did not complete within {self.request_timeout:g}s"
        if last_error is None:
            return GatewayError(said, status=504)
        return GatewayError(f"{said}; last failure: {last_error.message}", status=504,
                            detail=f"{said}; last failure: {last_error.detail}")


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
        if error.status == 504:  # it went silent: the continuation's deadlines are shorter
            self.tracked.silences += 1
        cont = Continuation.build(view, self.seen.objects()) if self.seen.usable else None
        if cont is None:
            self.failovers.labels(view.endpoint, "not_resumable").inc()
            self.tracked.failure = error
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
            self.tracked.failure = exc
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


class Shared:
    """What the attempts of one request learned, shared by the samples of an n > 1 request
    (`parallel_samples.Placement.shared`): a server one sample failed on is avoided by every
    sample's next pick, and once one sample was served a retry does not wait for servers
    to recover (a working pair exists; the hold of `Proxy._retrying` is skipped)."""

    __slots__ = ("blamed", "tried", "served")

    def __init__(self) -> None:
        self.blamed: dict[Server, float] = {}  # server -> when it was last blamed (monotonic)
        self.tried: list[Server] = []  # every server of a failed pair (`_doubtful`)
        self.served = False

    def blame(self, servers) -> None:
        if not servers:  # (most requests: nothing to blame, no clock read)
            return
        now = time.monotonic()
        for server in servers:
            self.blamed[server] = now

    def avoiding(self) -> list[Server]:
        """What the next pick avoids: the blamed servers that completed no request since
        they were blamed (one that did has recovered: when every server of a role was
        blamed, the pick goes to it rather than to any of them)."""
        if not self.blamed:  # (most requests: no comprehension frame)
            return []
        return [w for w, at in self.blamed.items() if w.last_success <= at]

    def failed(self, attempt: Attempt, exc: UpstreamError) -> None:
        """The retry avoids (softly: the scheduler ignores `avoid` when it would leave no
        candidate) the server to blame (`blame.culprits`): the leg that reported a failure
        is not always the one that failed, so both when the evidence does not tell."""
        self.blame(culprits(attempt.prefill, attempt.decode, exc.leg,
                            own=exc.upstream_status is None, rescued=exc.reason == RESCUED))
        self.tried += (attempt.prefill, attempt.decode)


def _doubtful(attempt: Attempt, tried: list[Server] | tuple) -> bool:
    """Whether the pair was picked with no sound choice left: one of its servers was in a
    pair that failed this request already, or was not usable (panic routing) or suspected
    hung."""
    prefill, decode, now = attempt.prefill, attempt.decode, time.monotonic()
    return (prefill in tried or not prefill.usable or prefill.suspect_until > now  # no
            or decode in tried or not decode.usable or decode.suspect_until > now)  # genexpr


def _reason(exc: UpstreamError) -> str:
    if exc.reason is not None:
        return exc.reason
    if exc.upstream_status is not None:
        return str(exc.upstream_status)
    return "timeout" if exc.status == 504 else "connection"
