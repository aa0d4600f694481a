"""uvicorn's httptools protocol with the limits a server facing strangers needs.

uvicorn (0.54-0.55) puts no bound on the size or number of request headers or on the URL, and no
deadline on a request's head or body: a client can grow the gateway's memory with endless
headers, or hold a connection (and a file descriptor) forever by sending its request one byte
at a time (slowloris) or not at all. This subclass adds, per connection:

* a deadline for the request head: from the connection's start (or the first byte of the
  next request on a kept-alive connection) to the end of the headers, `head_timeout`;
* a deadline for the body, from the end of the headers, `body_timeout`;
* at most `max_header_count` headers, `max_head_bytes` bytes of URL + headers: beyond that
  the answer is 431 (or 414 for the URL alone) and the connection closes;
* a deadline for a stalled response, `send_timeout`: when the client stops reading, the
  transport's write buffer passes its high-water mark and uvicorn's `send` waits for it to
  drain; if it stays paused that long, the connection is aborted (unflushed bytes dropped),
  the app sees `http.disconnect` and the scope carries `STALLED`, so the inference endpoints
  count a slow client and abort both PD legs. This holds for every response, streamed or not,
  whatever the relay's own watchdog does.

It also bounds the client connections served at once, `max_connections`, in place of
uvicorn's `limit_concurrency` (whose refusal is a `text/plain` 503 without Retry-After, and
which counts every open connection, the refused ones too, so a burst of connections beyond the
limit was refused whole): a connection takes a slot when it opens (or, if none was free then,
with its first request) and keeps it until it closes; a request on a connection without a
slot while all are taken is answered 503 `service_unavailable` with `Retry-After` and its
connection closed.

Refusals (400 for a request httptools cannot parse, 414, 431, 503) answer in the gateway's
error shape and close the connection. Each refusal, and each connection closed at its head
or body deadline, is counted by reason (`gateway_protocol_refusals_total`: the app never
sees them, so slowloris or a junk flood showed nowhere). uvicorn logs "Invalid HTTP request
received." for every request it cannot parse, ours refused too: a flood of junk wrote a log
line each; `QuietRefusals` lets one through a minute, with the count it held back. Everything else (parsing, flow control, keep-alive,
pipelining) stays uvicorn's. The limits are tested at the socket level in tests/security/.

The deadlines, and uvicorn's own keep-alive wait, cost nothing per request: each phase (head,
body, keep-alive wait) only notes when it ends, and one check per connection, every quarter
of the shortest limit (at most a second, on the gateway's `Timers`), closes a connection whose
phase ran out; `on_response_complete` is uvicorn's with that one change. A loop timer per
phase and per keep-alive wait cost about a tenth of the gateway's CPU per request
(docs/BENCHMARKS.md, "Gateway overhead"). What is copied from uvicorn (that
`on_response_complete`, and answers written without uvicorn's `send`) is in one class,
`uvicorn_send.UvicornSend`, which says which uvicorn version it follows.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import ServiceUnavailable, error_body
from gateway.routes.uvicorn_send import UvicornSend
from gateway.timers import Timers

INF = float("inf")
# seconds a connection that has sent nothing yet is given to send its request once the
# gateway shuts down: a client connected a moment before SIGTERM is answered, not cut off
FIRST_REQUEST_WAIT = 1.0


@dataclass(frozen=True)
class ServerLimits:
    head_timeout: float = 10.0
    body_timeout: float = 60.0
    max_header_count: int = 100
    max_head_bytes: int = 32 * 1024
    max_url_bytes: int = 8 * 1024
    send_timeout: float = 30.0
    # above clients' pool expiry (httpx: 5 s, uvicorn's own default here too): with equal
    # timeouts a client reused a connection as the gateway closed it ("Server disconnected
    # without sending a response"); --keep-alive-timeout
    keep_alive: float = 75.0
    max_connections: int = 0  # client connections served at once (0: no bound)

    @property
    def period(self) -> float:
        """How often a connection checks its deadlines: a quarter of the shortest, at most
        a second (a deadline is met at most that late)."""
        return min(1.0, self.head_timeout, self.body_timeout, self.keep_alive) / 4


REFUSED = {400: "malformed", 414: "url_too_long", 431: "headers_too_large",
           503: "connection_limit"}  # the counter's reasons
INVALID = "Invalid HTTP request received."  # uvicorn's warning, one per unparsable request
QUIET_FOR = 60.0  # seconds between two of those warnings let through
REASONS = {400: b"Bad Request", 414: b"URI Too Long", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}
BUSY_RETRY_AFTER = b"1"  # seconds: a slot frees when a connection closes
STALLED = "gateway.stalled"  # scope key set when the response stalled past send_timeout
DEPARTURE = "gateway.departure"  # scope key: the request's `Departure`
WHOLE = "gateway.whole"  # scope key: the request's `UvicornSend.whole`
CHUNKS = "gateway.chunks"  # scope key: the request's `UvicornSend.chunk`


class Departure:
    """Tells a request that its client left (the connection was lost before the response
    completed): the endpoint sets `callback`, the protocol calls it once. This replaces a
    watcher task per request waiting for `http.disconnect` (a task created and cancelled on
    every request: about 5% of the gateway's CPU per request).

    The departure is also kept, `gone`: a client can leave before the endpoint sets the
    callback (while a Responses turn waits for its store, say), and a watch set later must
    see that at once. Before, such a departure was told to nobody: both legs ran to the end
    for a client that was gone, and no disconnect was counted."""

    __slots__ = ("callback", "gone")

    def __init__(self) -> None:
        self.callback = None
        self.gone = False

    def __call__(self) -> None:
        self.gone = True
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


class ConnectionSlots:
    """The `max_connections` slots of one serving process, shared by its connections."""

    __slots__ = ("taken",)

    def __init__(self) -> None:
        self.taken = 0


class QuietRefusals(logging.Filter):
    """Lets uvicorn's "Invalid HTTP request received." through once per `QUIET_FOR` seconds,
    saying how many it held back (the counter has them all)."""

    def __init__(self) -> None:
        super().__init__()
        self.held, self.last = 0, float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != INVALID:
            return True
        now = time.monotonic()
        if now - self.last < QUIET_FOR:
            self.held += 1
            return False
        if self.held:
            record.msg = f"{INVALID} ({self.held} more in the last {QUIET_FOR:.0f} s, not "
            record.msg += "logged: gateway_protocol_refusals_total counts them)"
        self.held, self.last = 0, now
        return True


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing a request over the limits."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits and deadlines above; `guarded_protocol`
    binds the limits and the gateway's timers to a subclass (uvicorn takes a class)."""

    _limits: ServerLimits
    _timers: Timers
    _slots: ConnectionSlots
    _refused_as: Callable[[str], None]  # counts a refusal by reason

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._header_count = 0
        self._refused = False
        self._stall = None
        self._waiting = False  # in the keep-alive wait between two requests
        self._slot = False  # holds one of the max_connections slots
        self._closing = False  # the gateway shuts down: the next answer is the last
        self._admitted()  # a slot from the start, if one is free: an idle connection counts
        self._due = self._timers.loop().time() + self._limits.head_timeout
        self._check = self._timers.after(self._limits.period, self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._slot:
            self._slot = False
            self._slots.taken -= 1
        self._check.cancel()
        self._due = INF
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            departure = cycle.scope.get(DEPARTURE)
            if departure is not None:
                departure()

    def shutdown(self) -> None:
        """uvicorn's graceful stop closes every connection without an answer in progress,
        and with it a request on its way: a head half read, bytes not read yet, a client
        that connected but whose request has not arrived. Those are served, once, with
        `Connection: close`; only a connection idle between two requests closes at once.
        The head deadline bounds the wait, `FIRST_REQUEST_WAIT` the wait for bytes."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False  # uvicorn's own: the answer in progress is the last
            return
        self._closing = True
        if self._head_bytes and not self._waiting:  # a head half read
            return
        if self._unread() or not self._waiting:  # bytes on the way, or the first request
            self._due = min(self._due, self._timers.loop().time() + FIRST_REQUEST_WAIT)
            return
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self._timers.after(self._limits.send_timeout, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.scope[STALLED] = True
        self.transport.abort()  # close() would wait for the client to read the buffer

    def _phase(self, seconds: float) -> None:
        """The current phase (head, body, keep-alive wait) ends `seconds` from now."""
        self._due = self._timers.loop().time() + seconds

    def _tick(self) -> None:
        """The connection's periodic check: has its current phase run out?"""
        if self.transport.is_closing():
            return
        if self._timers.loop().time() < self._due:
            self._check = self._timers.after(self._limits.period, self._tick)
            return
        if self._waiting and self._unread():  # the next request came during a stall
            self._waiting = False
            self._phase(self._limits.head_timeout)
            self._check = self._timers.after(self._limits.period, self._tick)
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app sees http.disconnect
            self._refused_as("body_timeout")
        elif not self._waiting and not self._closing:  # the keep-alive wait is no refusal
            self._refused_as("head_timeout")
        self.transport.close()

    def _unread(self) -> bool:
        """Whether bytes (or the client's close) wait unread on the socket: after a stall
        (the process stopped, a wake-up without events) the loop may run this check before
        it reads them, and the keep-alive wait, over by the clock, is over by the client
        too."""
        sock = self.transport.get_extra_info("socket")
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (AttributeError, OSError, ValueError):
            return False

    def _answer(self, status: int, message: str, body: dict | None = None,
                extra: bytes = b"") -> None:
        """Write a refusal in the gateway's error shape and close the connection."""
        self._refused = True
        self._due = INF
        self._refused_as(REFUSED[status])
        data = orjson.dumps(body or error_body(message, "invalid_request_error", str(status)))
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"%sconnection: close\r\n\r\n%s" % (status, REASONS[status], len(data), extra, data))
        self.transport.close()

    def _admitted(self) -> bool:
        """Whether this connection has (or now takes) one of the `max_connections` slots."""
        if self._slot or not self._limits.max_connections:
            return True
        if self._slots.taken >= self._limits.max_connections:
            return False
        self._slots.taken += 1
        self._slot = True
        return True

    def _refuse(self, status: int) -> None:
        self._answer(status, REASONS[status].decode())
        raise _Refused

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # our own refusal already answered
            self._answer(400, "malformed HTTP request")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._header_count = 0
        if self._due == INF or self._waiting:  # not the connection's first head
            self._waiting = False
            self._phase(self._limits.head_timeout)

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self._limits.max_url_bytes:
            self._refuse(414)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        self._header_count += 1
        if self._header_count > self._limits.max_header_count \
                or self._head_bytes > self._limits.max_head_bytes:
            self._refuse(431)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if not self._admitted():
            err = ServiceUnavailable(f"the gateway is serving its limit of "
                                     f"{self._limits.max_connections} client connections; "
                                     "retry shortly")
            self._answer(503, err.message, err.body(),
                         b"retry-after: %s\r\n" % BUSY_RETRY_AFTER)
            raise _Refused
        self._phase(self._limits.body_timeout)
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None:
            if self._closing:
                cycle.keep_alive = False
            send = UvicornSend(cycle)
            cycle.scope[DEPARTURE] = Departure()
            cycle.scope[WHOLE] = send.whole
            cycle.scope[CHUNKS] = send.chunk

    def on_message_complete(self) -> None:
        self._due = INF  # the app answers now; a stalled answer has its own deadline
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if UvicornSend.response_complete(self):
            # the keep-alive wait: ended by the next request's first byte, or by _tick
            self._waiting = True
            self._phase(self._limits.keep_alive)


def guarded_protocol(limits: ServerLimits, timers: Timers,
                     refused_as: Callable[[str], None] = lambda reason: None
                     ) -> type[HttpToolsProtocol]:
    """A `GuardedHttpToolsProtocol` class bound to `limits`, the gateway's `timers` and the
    refusal counter `refused_as` (uvicorn instantiates it per connection); uvicorn's warning
    for each unparsable request quietened (once per process)."""
    errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietRefusals) for f in errors.filters):
        errors.addFilter(QuietRefusals())
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"_limits": limits, "_timers": timers, "_slots": ConnectionSlots(),
                 "_refused_as": staticmethod(refused_as)})
