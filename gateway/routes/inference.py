"""The inference endpoints as pure ASGI apps: the request path, kept short.

auth -> tenancy headers (tenant, priority class, deadline, session:
gateway/admission/tenancy.py) -> read body (charged to the in-flight body budget:
gateway/admission/body_budget.py) -> parse once -> the request's model
(gateway/scheduling/models.py: 404 for an unknown one) -> a prompt over the context by its size
alone refused -> count prompt tokens (exact with the model's tokenizer) -> per-key token limit
(x n samples; given back if refused before a server is asked) -> context check -> in-flight
table -> admission slot (fair queue) -> serve (one PD request, or n single-sample ones for n >
1) -> the answer, an ASGI response that sends itself (gateway/routes/answer.py). The disconnect
watch is armed once the body is read, so a client that leaves while its prompt is counted (a
server's /v1/tokenize may be slow) or while queued stops the request at once (a queued one
leaves the queue); one that left earlier (while a Responses turn waited for its store) stops it
there. The work runs in the request's own task, under one `Interrupt`: the client's departure
fires it (told by the server protocol directly, `server_protocol.Departure`; under another ASGI
server a watcher task waits for `http.disconnect` instead), `/abort_request` fires it when it
must stop the request itself, and the stream relay fires it when the client stops reading
(`--send-timeout`); the server protocol also cuts a connection whose response stalls that long
(`server_protocol.STALLED`: counted as a slow client too). Whatever fired, both upstream legs
are cancelled.

Each endpoint gets `InferenceParts`, built once by the app, never the whole gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.admission.auth import INFERENCE, Auth, Caller
from gateway.admission.body_budget import BodyBudget, BodyLease
from gateway.admission.key_limits import KeyLimits, KeyRateLimited
from gateway.admission.slots import Admission
from gateway.admission.tenancy import Tenancy, Ticket
from gateway.cancel import Interrupt
from gateway.dispatch.attempt import Answer
from gateway.dispatch.inflight import InFlight, Tracked, new_id, safe_id
from gateway.dispatch.relay import SlowClient
from gateway.errors import BadRequest, GatewayError, ServiceUnavailable
from gateway.observability.metrics import Metrics
from gateway.observability.usage import Usage
from gateway.reach import refuse_unallowed
from gateway.request import RequestView, parse_request
from gateway.routes.answer import (
    SHUTTING_DOWN,
    AnswerMeter,
    ClientWatch,
    StreamCut,
    answer_response,
)
from gateway.routes.asgi import ClientGone, header, read_body, send_error
from gateway.routes.state import RuntimeState
from gateway.scheduling.models import Models
from gateway.timers import Timers
from gateway.tokens.context_check import ContextCheck
from gateway.tokens.prompt_tokens import PromptTokens

log = logging.getLogger("gateway.inference")


@dataclass(frozen=True, slots=True)
class InferenceParts:
    """What the inference endpoints use, each part built when the gateway is; `serve` runs
    one admitted request (it needs the parts made at start, and is called only after)."""

    auth: Auth
    tenancy: Tenancy
    models: Models
    tokens: PromptTokens
    limits: KeyLimits
    context: ContextCheck
    inflight: InFlight
    admission: Admission
    usage: Usage
    metrics: Metrics
    timers: Timers
    tracing: Any  # observability.tracing.Tracing with --otlp-endpoint, else None
    state: RuntimeState
    serve: Callable[[RequestView, Tracked], Awaitable[Answer]]
    max_body_bytes: int
    max_items: int
    bodies: BodyBudget  # the bytes of bodies in flight (admission/body_budget.py)
    allowed: frozenset[str]  # what the operator lets bodies make the servers do (reach.py)
    slo: Any = None  # slo.gate.SloGate: objectives, and the early refusal of certain misses


def request_id_of(scope: Scope) -> str:
    """The client's `x-request-id` if it is a safe id (1-128 of A-Z a-z 0-9 . _ : -), else a
    new random one; the answer's `x-request-id` header says which was used."""
    given = header(scope, b"x-request-id")
    return given if safe_id(given) else new_id()


class InferenceEndpoint:
    def __init__(self, parts: InferenceParts, endpoint: str,
                 parse: Callable[[str, bytes | bytearray], RequestView] = parse_request) -> None:
        self.parts = parts
        self.endpoint = endpoint
        self.parse = parse  # an endpoint of another body shape brings its own (responses/)
        m = parts.metrics
        self._requests = {}
        self._e2e = m.buffered_histogram(m.e2e.labels(endpoint))
        self._meter = AnswerMeter(m, endpoint)
        self._disconnects = m.disconnects.labels(endpoint)
        self._slow = m.slow_clients.labels(endpoint)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parts = self.parts
        started = time.perf_counter()
        request_id = request_id_of(scope)
        status = 500
        interrupt = Interrupt(loop=parts.timers.loop())
        # tracing.RequestTrace with tracing on (--otlp-endpoint), else None
        trace = parts.tracing.request(scope, request_id) if parts.tracing is not None else None
        usage = parts.usage.begin(self.endpoint, request_id, started)
        lease = parts.bodies.lease()
        try:
            try:
                status = await self._serve(scope, receive, send, interrupt, trace, usage, lease)
            except asyncio.CancelledError:
                reason = interrupt.reason()
                if reason is None:  # not ours: uvicorn ends what outlived --shutdown-grace
                    if not parts.state.shutting_down:
                        raise
                    reason = ServiceUnavailable(SHUTTING_DOWN + " and the request outlived "
                                                "--shutdown-grace; retry",
                                                headers={"retry-after": "1"})
                if isinstance(reason, GatewayError):
                    raise reason from None
                status = 499
                if isinstance(reason, SlowClient):
                    self._slow.inc()
        except StreamCut as cut:  # the client has the error event already
            status = cut.error.status
            parts.state.note_error(cut.error, self.endpoint, request_id)
        except GatewayError as err:
            status = err.status
            parts.state.note_error(err, self.endpoint, request_id)
            await self.send_error(send, err, request_id)
        except (ClientGone, OSError):
            status = 499
        except Exception:  # a bug: answer 500 in the usual shape rather than drop the client
            await self._internal_error(send, request_id)
        finally:
            lease.release()
            interrupt.close()
            self._count(status, started)
            if trace is not None:
                trace.finish(status)
            parts.usage.finish(usage, status)

    async def _view(self, scope: Scope, receive: Receive, lease: BodyLease, caller: Caller,
                    ticket: Ticket, usage) -> RequestView:
        """The request parsed once, its model resolved, refused if its size alone is over the
        context. The body's bytes are not kept past parsing."""
        parts = self.parts
        view = self.parse(self.endpoint,
                          await read_body(scope, receive, parts.max_body_bytes,
                                          buffer=True, lease=lease))
        view.priority, view.session = ticket.klass, ticket.session  # completing the new view
        if view.needs:
            refuse_unallowed(view.needs, parts.allowed)  # 403: a URL to fetch, code to run
        parts.usage.parsed(usage, view)  # counted under its model, even when refused
        view = parts.models.resolve(view)  # 404 model_not_found
        items = view.room_count
        if items is not None and items > parts.max_items:
            raise BadRequest(f"{items} items (batch size x n) exceed the limit of "
                             f"{parts.max_items} per request")
        parts.context.refuse_by_size(view)  # over the context by its size alone: 400
        return view

    async def _serve(self, scope: Scope, receive: Receive, send: Send, interrupt: Interrupt,
                     trace, usage, lease: BodyLease) -> int:
        """Check, read and parse the request, then, in the in-flight table, wait for a slot,
        run it and send its answer, the client watched. One coroutine frame from the
        endpoint to the answer: a streamed answer resumes every frame on it per chunk."""
        parts = self.parts
        try:
            caller = parts.auth.caller(scope, INFERENCE)
        except KeyRateLimited as refused:  # a known key: its refusal counts under its tenant
            usage.tenant = parts.tenancy.tenant_of(refused.key_index).name
            raise
        usage.tenant = caller.tenant
        ticket = parts.tenancy.classify(scope["headers"], caller.key_index)
        view = await self._view(scope, receive, lease, caller, ticket, usage)
        with ClientWatch(interrupt, scope, receive) as watch:  # the body is read: watch now
            # its tokens counted and limited, its context checked, watched: a count may wait
            # (a server's /v1/tokenize), and a client that leaves meanwhile stops it at once
            if parts.tokens.wanted(view):
                view = await parts.tokens.count(view)
            view, tracked = await self._admitted(scope, view, caller, ticket, interrupt,
                                                 trace, usage)
            try:
                answer = await parts.serve(view, tracked)
                try:
                    response = answer_response(answer, tracked.request_id, watch,
                                               self._meter, usage, view)
                    await response(scope, receive, send)
                    if tracked.failure is not None:  # the stream's error event is out
                        raise StreamCut(tracked.failure)
                    return answer.status
                finally:
                    if answer.close is not None:
                        await answer.close()
            finally:
                parts.admission.release()
                parts.inflight.remove(tracked)
                tracked.attempts.clear()  # attempt -> tracked -> attempts: no cycle left

    async def _admitted(self, scope: Scope, view: RequestView, caller: Caller, ticket: Ticket,
                        interrupt: Interrupt, trace, usage) -> tuple[RequestView, Tracked]:
        """The request charged to its key's token limit (before it may queue: a key over its
        limit never waits for a slot), checked, in the in-flight table, holding a slot.
        Refused or gone before a server is asked: its tokens given back, here only, once."""
        parts = self.parts
        key = caller.key_index
        charged = parts.limits.take_tokens(key, view.prompt_tokens, view.n)
        try:
            counting = parts.context.check(view)  # a coroutine only near the context limit
            if counting is not None:
                view = await counting
            if parts.slo is not None:  # the request's latency objectives (400 if bad)
                view.slo = parts.slo.ticket(scope["headers"], ticket.klass, usage.request_id,
                                            view)
            tracked = Tracked(usage.request_id, caller.owner, view.rids or (),
                              interrupt=interrupt, trace=trace, usage=usage,
                              not_after=ticket.deadline)
            if trace is not None:
                trace.admitted(caller, view)
            parts.inflight.add(tracked)
            try:
                await parts.admission.acquire(ticket.tenant, ticket.klass, ticket.deadline)
                try:
                    if view.slo is not None:  # nothing starts that is certain to miss
                        await parts.slo.admit(view)
                except BaseException:
                    parts.admission.release()
                    raise
            except BaseException:
                parts.inflight.remove(tracked)
                tracked.attempts.clear()
                raise
        except BaseException:
            parts.limits.give_back(key, charged)
            raise
        return view, tracked

    async def _internal_error(self, send: Send, request_id: str) -> None:
        log.exception("unexpected error on %s (request %s)", self.endpoint, request_id)
        err = GatewayError("internal gateway error; see the gateway log", status=500)
        self.parts.state.note_error(err, self.endpoint, request_id)
        try:
            await self.send_error(send, err, request_id)
        except Exception:  # noqa: BLE001 - the response may have started already
            pass

    async def send_error(self, send: Send, err: GatewayError, request_id: str) -> None:
        """An error before the answer began, in this endpoint's shape (OpenAI's here)."""
        await send_error(send, err, request_id)

    def _count(self, status: int, started: float) -> None:
        counter = self._requests.get(status)
        if counter is None:
            metrics = self.parts.metrics
            counter = self._requests[status] = metrics.buffered_counter(
                metrics.requests.labels(self.endpoint, str(status)))
        counter.pending += 1
        self._e2e.observe(time.perf_counter() - started)
        if status == 499:
            self._disconnects.inc()
