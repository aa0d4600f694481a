"""OpenTelemetry spans of every request, and the W3C trace context sent on to SGLang.

Imported only when `--otlp-endpoint` is set (`runtime.Gateway`, extra `pd-gateway[tracing]`).
With tracing off nothing here is loaded, and each hook on the request path is one
`is not None` check of a field that stays None. With it on, one request gives:

    POST /generate   (SERVER; parent: the client's valid `traceparent`, else a new trace)
    ├── pick         scheduler decision and rooms: prefill [DP rank], decode, policies
    ├── prefill      (CLIENT) the prefill leg: server, status, retry number, room, outcome
    ├── decode       (CLIENT) the decode leg; for a stream it lasts until the stream ends
    └── relay        the stream to the client: chunks, bytes, end reason

and one more pick/prefill/decode (relay) per retry or continuation of a broken stream
(`gateway.retry`, `gateway.continuation`); why an attempt failed is an `attempt_failed` event
on the request span. Every span is started with an explicit parent: no context variable is
set, so nothing else in the process sees a "current span".

Propagation to SGLang: each leg's POST carries `traceparent` (and `tracestate`) naming that
leg's span. SGLang started with `--enable-trace` reads exactly these two headers
(`extract_trace_headers(request.headers)` in `TokenizerManager._init_req_state`,
managers/tokenizer_manager.py; `TRACE_HEADERS` in observability/trace.py) and starts its
request span as their child, so the prefill's and the decode's own spans sit under our leg
spans in one trace. (The native body field `external_trace_header` takes precedence there;
the gateway does not set it.)

A client's trace context is used only when valid (W3C Trace Context level 1, checked here
before the SDK sees it, so a hostile header costs no log line): exactly one `traceparent`,
lowercase hex, version 00 exactly 55 characters (a later version at most 128, `ff` never),
trace and parent ids not all zeros; `tracestate` (several headers joined by ",") at most 512
characters and 32 well-formed members, else dropped alone. Anything else is ignored and the
request starts a trace of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.observability.tracing_export import Export

MAX_TRACEPARENT = 128
MAX_TRACESTATE = 512
MAX_MEMBERS = 32
TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-[ -~]*)?")
MEMBER = re.compile(  # tracestate list-member: key=value (W3C Trace Context level 1, 3.3.1)
    r"(?:[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
    r"=[ -+\--<>-~]{0,255}[!-+\--<>-~]")
ROOT = Context()  # the parent of a request without a valid traceparent: none
PROPAGATOR = TraceContextTextMapPropagator()


def valid_traceparent(value: str) -> bool:
    match = TRACEPARENT.fullmatch(value)
    if match is None or len(value) > MAX_TRACEPARENT:
        return False
    version, trace_id, parent_id, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return False
    return trace_id != "0" * 32 and parent_id != "0" * 16


def valid_tracestate(value: str) -> bool:
    if len(value) > MAX_TRACESTATE:
        return False
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    keys = {m.split("=", 1)[0] for m in members}
    return (len(members) <= MAX_MEMBERS and len(keys) == len(members)
            and all(MEMBER.fullmatch(m) for m in members))


def client_carrier(headers: list[tuple[bytes, bytes]]) -> dict[str, str] | None:
    """The client's `traceparent` (and `tracestate`) if valid, else None."""
    parent: bytes | None = None
    states: list[bytes] = []
    for name, value in headers:
        if name == b"traceparent":
            if parent is not None:
                return None  # two of them: neither is trusted
            parent = value
        elif name == b"tracestate":
            states.append(value)
    if parent is None or len(parent) > MAX_TRACEPARENT:
        return None
    text = parent.decode("latin-1").strip(" \t")
    if not valid_traceparent(text):
        return None
    carrier = {"traceparent": text}
    state = b",".join(states)
    if state and len(state) <= MAX_TRACESTATE:
        state_text = state.decode("latin-1")
        if valid_tracestate(state_text):
            carrier["tracestate"] = state_text
    return carrier


class Tracing:
    """The tracer of one serving process: the entry point of every request's spans."""

    def __init__(self, config, metrics, policies_of: Callable, version: str) -> None:
        self.export = Export(config.otlp_endpoint, config.otlp_protocol,
                             config.otlp_sample_ratio, config.otlp_service_name, version,
                             metrics)
        # server -> its model's policies by role (those that chose it), for the pick spans
        self.policies_of = policies_of
        self.tracer = None

    def start(self) -> None:
        self.tracer = self.export.start().get_tracer("pd-gateway")

    def stop(self) -> None:
        """Blocking (flushes what is queued, bounded): run off the event loop."""
        self.export.stop()

    def request(self, scope, request_id: str) -> RequestTrace:
        carrier = client_carrier(scope["headers"])
        parent = PROPAGATOR.extract(carrier) if carrier is not None else ROOT
        path = scope["path"]
        span = self.tracer.start_span(
            f"POST {path}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": path,
                        "gateway.request_id": request_id})
        return RequestTrace(self, span)


def trace_headers(span) -> tuple[tuple[str, str], ...]:
    """`traceparent` (and `tracestate`) naming `span`, as a leg sends them."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, set_span_in_context(span, ROOT))
    return tuple(carrier.items())


class RequestTrace:
    """One request's span, the parent of its picks, legs and relays. A request the sampler
    left out makes no child spans: its legs carry the request span's context (flag "not
    sampled", so SGLang records nothing either), made once."""

    __slots__ = ("tracing", "span", "context", "attempts", "recording", "unsampled")

    def __init__(self, tracing: Tracing, span) -> None:
        self.tracing = tracing
        self.span = span
        self.recording = span.is_recording()
        self.context = set_span_in_context(span, ROOT) if self.recording else None
        self.unsampled = () if self.recording else trace_headers(span)
        self.attempts = 0

    def admitted(self, caller, view) -> None:
        """Who asked for what, once the request is authenticated and parsed."""
        if self.recording:
            self.span.set_attributes({
                "gateway.tenant": caller.tenant, "gateway.stream": view.stream,
                "gateway.items": (view.room_count or 1) * view.n,
                "gateway.prompt_tokens": view.prompt_tokens})
            if view.model is not None:
                self.span.set_attribute("gateway.model", view.model)

    def picked(self, attempt, retry: int, depth: int, started_ns: int) -> AttemptTrace:
        """The scheduler chose a pair (and the dispatcher gave it rooms): a finished span."""
        self.attempts += 1
        if self.recording:
            policies = self.tracing.policies_of(attempt.prefill)
            attributes = {"gateway.retry": retry, "gateway.prefill.server": attempt.prefill.url,
                          "gateway.decode.server": attempt.decode.url,
                          "gateway.prefill.policy": policies["prefill"].name,
                          "gateway.decode.policy": policies["decode"].name}
            if attempt.prefill_rank is not None:
                attributes["gateway.prefill.dp_rank"] = attempt.prefill_rank
            if depth:
                attributes["gateway.continuation"] = depth
            self.tracing.tracer.start_span("pick", context=self.context, attributes=attributes,
                                           start_time=started_ns).end()
        return AttemptTrace(self, attempt, retry)

    def failed(self, error, retry: int) -> None:
        """Why an attempt failed (the retry decision follows)."""
        if self.recording:
            self.span.add_event("attempt_failed", {
                "gateway.retry": retry, "gateway.leg": error.leg or "",
                "gateway.retryable": error.retryable, "exception.message": error.detail})

    def finish(self, status: int) -> None:
        span = self.span
        if self.recording:
            span.set_attributes({"http.response.status_code": status,
                                 "gateway.attempts": self.attempts})
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        span.end()


class AttemptTrace:
    """The leg spans and the relay span of one attempt (none when not recording)."""

    __slots__ = ("request", "attempt", "retry", "legs", "statuses", "relay", "chunks", "bytes")

    def __init__(self, request: RequestTrace, attempt, retry: int) -> None:
        self.request = request
        self.attempt = attempt
        self.retry = retry
        self.legs: dict = {}
        self.statuses: dict[str, int] = {}
        self.relay = None
        self.chunks = 0
        self.bytes = 0

    def leg_started(self, leg: str, server) -> tuple[tuple[str, str], ...]:
        """Start the leg's span; the headers that carry it to the server."""
        request = self.request
        if not request.recording:
            return request.unsampled
        attempt = self.attempt
        rooms = attempt.rooms
        span = request.tracing.tracer.start_span(
            leg, context=request.context, kind=SpanKind.CLIENT,
            attributes={"gateway.retry": self.retry, "server.address": server.url,
                        "gateway.rid": attempt.rid_list[0],
                        "gateway.bootstrap_room": rooms if isinstance(rooms, int) else rooms[0]})
        self.legs[leg] = span
        return trace_headers(span)

    def answered(self, leg: str, status: int) -> None:
        self.statuses[leg] = status
        span = self.legs.get(leg)
        if span is not None:
            span.set_attribute("http.response.status_code", status)

    def leg_done(self, leg: str, ok: bool | None) -> None:
        """ok: True answered, False failed (the server's fault), None neither: cancelled,
        or refused (a 4xx, the request's fault)."""
        span = self.legs.pop(leg, None)
        if span is None:  # stopped before it was sent, or not recording
            return
        refused = self.statuses.get(leg, 0) >= 400
        outcome = "ok" if ok else "failed" if ok is False else "refused" if refused \
            else "cancelled"
        span.set_attribute("gateway.outcome", outcome)
        if ok is False or refused:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def relay_started(self) -> None:
        request = self.request
        if request.recording:
            self.relay = request.tracing.tracer.start_span(
                "relay", context=request.context, attributes={"gateway.retry": self.retry})

    def relayed(self, data: bytes) -> None:
        self.chunks += 1
        self.bytes += len(data)

    def relay_done(self, ok: bool | None, broken: bool) -> None:
        """End reason: complete, error (an error event ended it), failover (continued on
        another pair), or the client's doing: client_gone, slow_client, cancelled."""
        span = self.relay
        if span is None:
            return
        self.relay = None
        if ok:
            reason = "complete"
        elif ok is False:
            reason = "failover" if broken else "error"
        else:
            tracked = self.attempt.tracked
            why = tracked.interrupt.reason() if tracked is not None else None
            reason = {"ClientGone": "client_gone", "SlowClient": "slow_client"}.get(
                type(why).__name__, "cancelled")
        span.set_attributes({"gateway.relay.chunks": self.chunks,
                             "gateway.relay.bytes": self.bytes, "gateway.relay.end": reason})
        if reason == "error":
            span.set_status(Status(StatusCode.ERROR))
        span.end()
