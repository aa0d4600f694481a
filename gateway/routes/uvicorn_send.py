"""What the gateway copies from uvicorn's internals, in one class: `UvicornSend`.

It follows uvicorn 0.54-0.55's `httptools_impl` (pyproject pins `uvicorn>=0.54,<0.56`;
tests/unit/routes/test_uvicorn_send.py compares its bytes and state with uvicorn's own `send`
and fails on a version outside that range). It is copied, not called, because uvicorn's
`send` costs a message dict and a coroutine per write and writes a complete answer in two
`send(2)` calls, and its `on_response_complete` arms a loop timer per keep-alive wait: in the
gateway's hot path that cost about a tenth of its CPU per request (docs/BENCHMARKS.md,
"Gateway overhead": the device run's third run, one write per answer, and the 2-core runs
after the reference-cycle fix, one write per chunk; docs/ARCHITECTURE.md, "Request path"). A new uvicorn release is adopted by re-reading `RequestResponseCycle.send` and `HttpToolsProtocol.on_response_complete` against this class.
"""

from __future__ import annotations

import weakref

from uvicorn.protocols.http.httptools_impl import (
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

UVICORN_VERSIONS = ((0, 54), (0, 55))  # the releases whose internals this module follows


class UvicornSend:
    """Writes on one uvicorn `RequestResponseCycle` without going through its `send`.

    `whole` and `chunk` decline (False: send as usual) wherever `send` would wait (the write
    buffer over its high-water mark: backpressure and the send deadline stay uvicorn's) or do
    more; what they set on the cycle is what `send` sets for the same bytes. The cycle is held
    weakly, so the scope holding these methods does not keep it alive (no reference cycle per
    request)."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def whole(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Write a complete answer (status line, headers, body) in one `transport.write`. The
        header names are the gateway's own constants; a value with a control character (a
        content type relayed from a server) makes it decline, as `send` would refuse it."""
        cycle = self._cycle()
        if cycle is None or cycle.response_started or cycle.disconnected \
                or cycle.flow.write_paused:
            return False
        for _, value in headers:
            if HEADER_VALUE_RE.search(value):
                return False
        cycle.response_started = cycle.response_complete = True
        cycle.waiting_for_100_continue = False
        parts = [STATUS_LINE[status]]
        for name, value in cycle.default_headers:
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"content-length: %d\r\n" % len(body))
        if not cycle.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", body)
        cycle.transport.write(b"".join(parts))
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()
        return True

    def chunk(self, body: bytes) -> bool:
        """Write one chunk of a chunked body, framed as `send` frames it. Only between the
        start and the end of a chunked response: the last, empty chunk always goes through
        `send`, which completes the cycle."""
        cycle = self._cycle()
        if cycle is None or not cycle.response_started or cycle.response_complete \
                or cycle.disconnected or cycle.flow.write_paused or not cycle.chunked_encoding \
                or not body:
            return False
        cycle.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        return True

    @staticmethod
    def response_complete(protocol: HttpToolsProtocol) -> bool:
        """uvicorn's `on_response_complete` without its keep-alive timer: True when the
        connection now waits for its next request (the caller times that wait)."""
        protocol.server_state.total_requests += 1
        if protocol.transport.is_closing():
            return False
        protocol._unset_keepalive_if_required()
        protocol.flow.resume_reading()
        if protocol.pipeline:
            cycle, app = protocol.pipeline.pop()
            protocol._start_asgi_task(cycle, app)
            return False
        return True
