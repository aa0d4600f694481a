"""A lean HTTP/1.1 load-generator client: one keep-alive connection, one request at a time.

The load generator shares one core with the simulated servers, so it must cost little per
request: an `asyncio.Protocol` on uvloop, responses parsed by httptools (C), request bytes
prepared by the caller, no header objects, no pool. A streamed body is not kept: its SSE
events are counted as the chunks arrive (`data:` at the start of a line, carried across chunk
boundaries).
"""

from __future__ import annotations

import asyncio
import socket
import time

import httptools


class ReplyError(Exception):
    """A request failed: a non-200 status, a lost connection or an unparsable answer."""


def post(host: str, port: int, path: str, body: bytes) -> bytes:
    """The complete bytes of a keep-alive `POST path` with a JSON body."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode("ascii") + body


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.events = 0
        self.line_start = True  # the next body byte starts an SSE line
        self.body_size = 0
        self.closed = False
        self.sent_at = 0.0
        self.first_event: float | None = None  # seconds from the send to the first event

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ReplyError(f"bad HTTP answer: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ReplyError(f"connection lost: {exc or 'closed by peer'}"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        count = body.count(b"\ndata:")
        if self.line_start and body.startswith(b"data:"):
            count += 1
        if count and self.first_event is None:
            self.first_event = time.perf_counter() - self.sent_at
        self.events += count
        self.line_start = body.endswith(b"\n")

    def on_message_complete(self) -> None:
        if not self.parser.should_keep_alive():
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self.parser.get_status_code())

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class Connection:
    """A keep-alive connection to host:port that reopens itself after the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._proto: _Protocol | None = None
        self.first_event: float | None = None  # of the last answer: seconds to its first event

    async def _ensure(self) -> _Protocol:
        if self._proto is None or self._proto.closed:
            loop = asyncio.get_running_loop()
            _, proto = await loop.create_connection(_Protocol, self.host, self.port)
            self._proto = proto
        return self._proto

    async def send(self, raw: bytes) -> tuple[int, int]:
        """Send prepared request bytes; return (SSE events, body bytes) of a 200 answer."""
        try:
            proto = await self._ensure()
        except OSError as exc:
            raise ReplyError(f"connect to {self.host}:{self.port} failed: {exc}") from exc
        proto.events, proto.body_size, proto.line_start = 0, 0, True
        proto.first_event, self.first_event = None, None
        proto.waiter = asyncio.get_running_loop().create_future()
        proto.sent_at = time.perf_counter()
        proto.transport.write(raw)
        try:
            status = await proto.waiter
        except asyncio.CancelledError:
            self.close()
            raise
        if status != 200:
            raise ReplyError(f"status {status} from {self.host}:{self.port}")
        self.first_event = proto.first_event
        return proto.events, proto.body_size

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None
