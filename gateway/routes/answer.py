"""An upstream answer as an ASGI response, like Starlette's `StreamingResponse`: it sends
itself, and what it sends is observed by the endpoint's meter (time to first byte, gaps
between chunks, bytes) and by the request's usage record (time to first byte, the final
events that carry the completion tokens).

The client's departure is watched by `ClientWatch`, armed once the request's body is read (a
client that leaves while its prompt is counted, or while queued, stops the request at once)
and told by the answer when it is sent; a client that left before the watch was armed stops
the request as the watch is armed.
An error after the head is out can only end the stream: the answer sends an error event and
`[DONE]`, then raises `StreamCut` so that the endpoint counts it without answering again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import Receive, Scope, Send

from gateway.anthropic.errors import error_event
from gateway.cancel import Interrupt
from gateway.dispatch.attempt import Answer
from gateway.dispatch.relay import SlowClient
from gateway.errors import GatewayError, ServiceUnavailable
from gateway.observability.answer_tokens import StreamTokens
from gateway.request import MESSAGES
from gateway.routes.asgi import ClientGone
from gateway.routes.server_protocol import CHUNKS, DEPARTURE, STALLED, WHOLE
from gateway.sse import DONE, frame

log = logging.getLogger("gateway.inference")
SHUTTING_DOWN = "the gateway is shutting down"  # what a request cut by the stop is told


class StreamCut(Exception):
    """A streamed answer ended early with `error`; the client already has the error event."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.detail)
        self.error = error


class ClientWatch:
    """Fires the request's interrupt when the client disconnects, until the answer is sent;
    a connection the server cut because the client stopped reading counts as a slow client.
    Under our server protocol the protocol calls `left` (no task per request); under another
    ASGI server a task waits for `http.disconnect`. A client that left before the watch
    (the protocol's `Departure.gone`) raises `ClientGone` here: the request stops as the
    interrupt would have stopped it, which cannot fire in its own task."""

    __slots__ = ("interrupt", "done", "scope", "_departure", "_task")

    def __init__(self, interrupt: Interrupt, scope: Scope, receive: Receive) -> None:
        self.interrupt = interrupt
        self.done = False
        self.scope = scope
        self._task: asyncio.Task | None = None
        self._departure = departure = scope.get(DEPARTURE)
        if departure is not None:
            if departure.gone:  # left before the watch: nothing more is done for it
                raise ClientGone
            departure.callback = self.left
        else:
            self._task = asyncio.get_running_loop().create_task(self._listen(receive))

    def __enter__(self) -> ClientWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.done = True
        if self._departure is not None:
            self._departure.callback = None
        else:
            self._task.cancel()

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.left()

    def left(self) -> None:
        if not self.done:
            self.interrupt.fire(SlowClient() if self.scope.get(STALLED) else ClientGone())


class AnswerMeter:
    """One endpoint's figures of what its answers sent (buffered metric children)."""

    __slots__ = ("ttft", "itl", "bytes")

    def __init__(self, metrics, endpoint: str) -> None:
        self.ttft = {stream: metrics.buffered_histogram(
            metrics.ttft.labels(endpoint, str(stream).lower())) for stream in (False, True)}
        self.itl = metrics.buffered_histogram(metrics.itl.labels(endpoint))
        self.bytes = metrics.buffered_counter(metrics.stream_bytes.labels(endpoint))


def answer_response(answer: Answer, request_id: str, watch: ClientWatch, meter: AnswerMeter,
                    usage, view) -> WholeAnswer | StreamedAnswer:
    """The response that sends `answer` (a whole body or a stream)."""
    headers = [(b"content-type", answer.content_type), (b"x-request-id", request_id.encode())]
    if view.endpoint == MESSAGES:  # where Anthropic's SDK reads the id (`_request_id`)
        headers.append((b"request-id", headers[1][1]))
    if answer.stream is None:
        return WholeAnswer(answer, headers, watch, meter, usage)
    return StreamedAnswer(answer, headers, watch, meter, usage, view)


class WholeAnswer:
    """A whole body: one write under our server protocol, else head then body."""

    __slots__ = ("answer", "headers", "watch", "meter", "usage")

    def __init__(self, answer: Answer, headers: list, watch: ClientWatch, meter: AnswerMeter,
                 usage) -> None:
        self.answer, self.headers, self.watch = answer, headers, watch
        self.meter, self.usage = meter, usage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer, headers, usage = self.answer, self.headers, self.usage
        whole = scope.get(WHOLE)
        if whole is not None and whole(answer.status, headers, answer.body):
            self.watch.done = True
        else:
            headers.append((b"content-length", str(len(answer.body)).encode()))
            await send({"type": "http.response.start", "status": answer.status,
                        "headers": headers})
            self.watch.done = True
            await send({"type": "http.response.body", "body": answer.body})
        usage.ttft = time.perf_counter() - usage.started
        usage.tail = answer.body  # its completion tokens are read once it is counted
        self.meter.ttft[False].observe(usage.ttft)
        self.meter.bytes.pending += len(answer.body)


class StreamedAnswer:
    """An event stream, relayed chunk by chunk; a usage event the client did not ask for is
    cut (the meter counts it), and a stream cut short ends with an error event."""

    __slots__ = ("answer", "headers", "watch", "meter", "usage", "view")

    def __init__(self, answer: Answer, headers: list, watch: ClientWatch, meter: AnswerMeter,
                 usage, view) -> None:
        self.answer, self.headers, self.watch = answer, headers, watch
        self.meter, self.usage, self.view = meter, usage, view

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send every chunk (one write per chunk under our server protocol: `direct`), timing
        the first and the gaps. The loop is here, not in a helper coroutine: every frame
        between the endpoint and the relay is resumed once per chunk."""
        self.headers.append((b"cache-control", b"no-cache"))
        self.headers.append((b"x-accel-buffering", b"no"))
        await send({"type": "http.response.start", "status": self.answer.status,
                    "headers": self.headers})
        direct, usage, itl = scope.get(CHUNKS), self.usage, self.meter.itl
        meter = usage.meter = StreamTokens.of(self.view)  # None for most: read at the end
        marks = meter.marks if meter is not None else None
        sent, last, previous, final = 0, 0.0, b"", b""
        error: GatewayError | None = None
        try:
            async for chunk in self.answer.stream:
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
                    usage.ttft = now - usage.started
                    self.meter.ttft[True].observe(usage.ttft)
                    if self.view.slo is not None:  # the SLO model learns it now
                        self.view.slo.first_token(now)
                last = now
                sent += len(chunk)
                previous, final = final, chunk
        except asyncio.CancelledError:
            if not self.watch.interrupt.fired:  # shutting down: end the stream properly
                error = ServiceUnavailable(SHUTTING_DOWN + "; the stream was cut")
            else:
                error = self.watch.interrupt.reason()  # ours: told to the client below
                if not isinstance(error, GatewayError):
                    raise
        except GatewayError as err:
            error = err
        finally:
            usage.tail = previous + final  # the final events: completion tokens
        self.watch.done = True
        if error is not None:
            await end_stream_early(send, usage.request_id, error, self.view)
            raise StreamCut(error)
        await send({"type": "http.response.body", "body": b""})
        self.meter.bytes.pending += sent


async def end_stream_early(send: Send, request_id: str, err: GatewayError | None = None,
                           view=None) -> None:
    """Close a cut stream with an error event and [DONE] (an Anthropic stream: its `error`
    event), not a truncated body."""
    err = err or ServiceUnavailable(SHUTTING_DOWN + "; the stream was cut")
    if view is not None and view.endpoint == MESSAGES:
        body = b"\n\n" + error_event(err)
    else:
        body = b"\n\n" + frame(err.body()) + DONE
    try:
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except Exception:  # noqa: BLE001 - best effort on the way out
        log.debug("could not end stream of request %s", request_id)
