"""The inference endpoints as pure ASGI apps: the request path, kept short.

auth -> tenancy headers (tenant, priority class, deadline, session: gateway/admission/tenancy.py) ->
read body -> parse once -> the request's model (gateway/scheduling/models.py: 404 for an unknown one) ->
count prompt tokens (exact with the model's tokenizer) -> per-key token limit -> context check
-> in-flight table -> admission slot (fair queue) -> serve (one PD request, or n
single-sample ones for n > 1) -> answer. The disconnect watch is armed before the admission
wait, so a client that leaves while queued leaves the queue at once. The work runs in the
request's own task, under one `Interrupt`: the client's departure fires it (told by the
server protocol directly, `server_protocol.Departure`; under another ASGI server a watcher
task waits for `http.disconnect` instead), `/abort_request` fires it when it must stop the request itself, and the stream relay fires it when the client stops
reading (`--send-timeout`); the server protocol also cuts a connection whose response stalls
that long (`server_protocol.STALLED`: counted as a slow client too). Whatever fired, both
upstream legs are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import Receive, Scope, Send

from gateway.admission.auth import INFERENCE
from gateway.admission.tenancy import Ticket
from gateway.cancel import Interrupt
from gateway.dispatch.attempt import Answer
from gateway.dispatch.inflight import Tracked, new_id, safe_id
from gateway.dispatch.relay import SlowClient
from gateway.errors import BadRequest, GatewayError, ServiceUnavailable
from gateway.observability.answer_tokens import StreamTokens
from gateway.request import parse_request
from gateway.routes.asgi import ClientGone, header, read_body, send_error
from gateway.routes.server_protocol import CHUNKS, DEPARTURE, STALLED, WHOLE
from gateway.sse import DONE, frame

log = logging.getLogger("gateway.inference")


class _Watch:
    """Fires the request's interrupt when the client disconnects, unless the answer is sent;
    a connection the server cut because the client stopped reading counts as a slow client."""

    __slots__ = ("interrupt", "done", "scope")

    def __init__(self, interrupt: Interrupt, scope: Scope) -> None:
        self.interrupt = interrupt
        self.done = False
        self.scope = scope

    async def __call__(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.left()

    def left(self) -> None:
        if not self.done:
            self.interrupt.fire(SlowClient() if self.scope.get(STALLED) else ClientGone())


def request_id_of(scope: Scope) -> str:
    """The client's `x-request-id` if it is a safe id (1-128 of A-Z a-z 0-9 . _ : -), else a
    new random one; the answer's `x-request-id` header says which was used."""
    given = header(scope, b"x-request-id")
    return given if safe_id(given) else new_id()


class InferenceEndpoint:
    def __init__(self, gateway, endpoint: str) -> None:
        self.gw = gateway
        self.endpoint = endpoint
        m = gateway.metrics
        self._requests = {}
        self._e2e = m.buffered_histogram(m.e2e.labels(endpoint))
        self._ttft = {stream: m.buffered_histogram(m.ttft.labels(endpoint, str(stream).lower()))
                      for stream in (False, True)}
        self._itl = m.buffered_histogram(m.itl.labels(endpoint))
        self._bytes = m.buffered_counter(m.stream_bytes.labels(endpoint))
        self._disconnects = m.disconnects.labels(endpoint)
        self._slow = m.slow_clients.labels(endpoint)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gw
        started = time.perf_counter()
        request_id = request_id_of(scope)
        status = 500
        interrupt = Interrupt(loop=gw.timers.loop())
        state = {"started": False}
        # tracing.RequestTrace with tracing on (--otlp-endpoint), else None
        trace = gw.tracing.request(scope, request_id) if gw.tracing is not None else None
        usage = gw.usage.begin(self.endpoint, request_id, started)
        try:
            try:
                caller = gw.auth.caller(scope, INFERENCE)
                usage.tenant = caller.tenant
                ticket = gw.tenancy.classify(scope["headers"], caller.key_index)
                raw = await read_body(scope, receive, gw.config.max_body_bytes)
                view = parse_request(self.endpoint, raw)
                view.priority, view.session = ticket.klass, ticket.session  # completing the new view
                gw.usage.parsed(usage, view)  # counted under its model, even when refused
                view = gw.models.resolve(view)  # 404 model_not_found
                items = view.room_count
                if items is not None and items > gw.config.max_items:
                    raise BadRequest(f"{items} items (batch size x n) exceed the limit of "
                                     f"{gw.config.max_items} per request")
                if gw.tokens.wanted(view):
                    view = await gw.tokens.count(view)
                gw.limits.take_tokens(caller.key_index, view.prompt_tokens)
                counting = gw.context.check(view)  # a coroutine only near the context limit
                if counting is not None:
                    await counting
                tracked = Tracked(request_id, caller.owner, view.rids or (), interrupt=interrupt,
                                  trace=trace, usage=usage, not_after=ticket.deadline)
                if trace is not None:
                    trace.admitted(caller, view)
                gw.inflight.add(tracked)
                try:
                    status = await self._serve(view, tracked, ticket, scope, receive, send,
                                               started, state, usage)
                finally:
                    gw.inflight.remove(tracked)
                    tracked.attempts.clear()  # attempt -> tracked -> attempts: no cycle left
            except asyncio.CancelledError:
                reason = interrupt.reason()
                if reason is None:
                    raise
                if isinstance(reason, GatewayError):
                    raise reason from None
                status = 499
                if isinstance(reason, SlowClient):
                    self._slow.inc()
        except GatewayError as err:
            status = err.status
            gw.note_error(err, self.endpoint, request_id)
            if state["started"]:
                await _end_stream_early(send, request_id, err)
            else:
                await send_error(send, err, request_id)
        except (ClientGone, OSError):
            status = 499
        except Exception:  # a bug: answer 500 in the usual shape rather than drop the client
            log.exception("unexpected error on %s (request %s)", self.endpoint, request_id)
            err = GatewayError("internal gateway error; see the gateway log", status=500)
            gw.note_error(err, self.endpoint, request_id)
            try:
                await send_error(send, err, request_id)
            except Exception:  # noqa: BLE001 - the response may have started already
                pass
        finally:
            interrupt.close()
            counter = self._requests.get(status)
            if counter is None:
                counter = self._requests[status] = gw.metrics.buffered_counter(
                    gw.metrics.requests.labels(self.endpoint, str(status)))
            counter.pending += 1
            self._e2e.observe(time.perf_counter() - started)
            if status == 499:
                self._disconnects.inc()
            if trace is not None:
                trace.finish(status)
            gw.usage.finish(usage, status)

    async def _serve(self, view, tracked: Tracked, ticket: Ticket, scope: Scope,
                     receive: Receive, send: Send, started: float, state: dict, usage) -> int:
        """Wait for a slot, run the request and send its answer, while a watcher listens for
        a disconnect."""
        watch = _Watch(tracked.interrupt, scope)
        departure = scope.get(DEPARTURE)
        watcher = None
        if departure is not None:  # no task per request: the protocol calls us
            departure.callback = watch.left
        else:
            watcher = asyncio.get_running_loop().create_task(watch(receive))
        admission = self.gw.admission
        try:
            await admission.acquire(ticket.tenant, ticket.klass, ticket.deadline)
            try:
                answer: Answer = await self.gw.serve(view, tracked)
                try:
                    return await self._send_answer(answer, tracked.request_id, send, started,
                                                   watch, state, usage, view)
                finally:
                    if answer.close is not None:
                        await answer.close()
            finally:
                admission.release()
        finally:
            watch.done = True
            if departure is not None:
                departure.callback = None
            else:
                watcher.cancel()

    async def _send_answer(self, answer: Answer, request_id: str, send: Send, started: float,
                           watch: _Watch, state: dict, usage, view) -> int:
        headers = [(b"content-type", answer.content_type),
                   (b"x-request-id", request_id.encode())]
        if answer.stream is None:
            whole = watch.scope.get(WHOLE)  # one write under our server protocol
            if whole is not None and whole(answer.status, headers, answer.body):
                watch.done = True
            else:
                headers.append((b"content-length", str(len(answer.body)).encode()))
                await send({"type": "http.response.start", "status": answer.status,
                            "headers": headers})
                watch.done = True
                await send({"type": "http.response.body", "body": answer.body})
            usage.ttft = time.perf_counter() - started
            usage.tail = answer.body  # its completion tokens are read once it is counted
            self._ttft[False].observe(usage.ttft)
            self._bytes.pending += len(answer.body)
            return answer.status
        headers.append((b"cache-control", b"no-cache"))
        headers.append((b"x-accel-buffering", b"no"))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        state["started"] = True
        itl = self._itl
        sent = 0
        last = 0.0
        meter = usage.meter = StreamTokens.of(view)  # None for most: read at the end only
        marks = meter.marks if meter is not None else None
        previous = final = b""
        direct = watch.scope.get(CHUNKS)  # one write per chunk under our server protocol
        try:
            async for chunk in answer.stream:
                if marks is not None and (marks[0] in chunk or marks[1] in chunk):
                    chunk = meter.feed(chunk)  # the usage event the client did not ask for
                    if not chunk:              # is cut; a batch's final events are counted
                        continue
                if direct is None or not direct(chunk):
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
                now = time.perf_counter()
                if last:
                    itl.observe(now - last)
                else:
                    usage.ttft = now - started
                    self._ttft[True].observe(usage.ttft)
                last = now
                sent += len(chunk)
                previous, final = final, chunk
        except asyncio.CancelledError:
            if not watch.interrupt.fired:  # the server is shutting down: end the stream properly
                await _end_stream_early(send, request_id)
            raise
        finally:
            usage.tail = previous + final  # the final events: completion tokens
        watch.done = True
        await send({"type": "http.response.body", "body": b""})
        self._bytes.pending += sent
        return answer.status


async def _end_stream_early(send: Send, request_id: str, err: GatewayError | None = None) -> None:
    """Close a cut stream with an error event and [DONE], not a truncated body."""
    err = err or ServiceUnavailable("the gateway is shutting down; the stream was cut")
    body = b"\n\n" + frame(err.body()) + DONE
    try:
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except Exception:  # noqa: BLE001 - best effort on the way out
        log.debug("could not end stream of request %s", request_id)
