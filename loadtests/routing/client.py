"""One streamed request, timed: time to the first content chunk, the reply, the usage figures.

Each request opens its own connection (`Connection: close`), as a new chat turn from another
client would: the proxies' handling of reused client connections (sglang-router does not set
TCP_NODELAY on accepted sockets, which costs ~40 ms per stream on a reused one) is measured in
"Gateway overhead", not here, where only routing should differ.

Raw asyncio with httptools (C) for the HTTP framing: the load generator shares two cores with
eight servers and the proxy, so it must be cheap. SSE events are parsed as they arrive, one
JSON decode per event; the endpoint kind decides what an event means:

* chat (`/v1/chat/completions`): `choices[0].delta.content` pieces; `usage` (with
  `stream_options.include_usage`) gives prompt, cached and completion tokens; an `error`
  object ends the stream as a failure.
* generate (`/generate`): cumulative `text`; `meta_info` gives prompt, cached and completion
  tokens; `finish_reason.type == "abort"` is a failure.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass

import httptools
import orjson

HOST = "127.0.0.1"


@dataclass
class Reply:
    ok: bool = False
    error: str | None = None
    status: int = 0  # the HTTP status (0: no answer), so callers can tell a shed from a failure
    ttft: float | None = None  # seconds from sending to the first non-empty content
    latency: float = 0.0  # seconds from sending to the end of the stream
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


class _Events:
    """Accumulates one streamed answer; `feed` takes raw body bytes."""

    def __init__(self, chat: bool, started: float) -> None:
        self.chat = chat
        self.started = started
        self.reply = Reply()
        self.pieces: list[str] = []
        self.pending = b""
        self.done = False

    def feed(self, data: bytes) -> None:
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:].strip())

    def _event(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self._fail(f"undecodable event {payload[:80]!r}")
            return
        if self.chat:
            self._chat(event)
        else:
            self._generate(event)

    def _first(self, content: str) -> None:
        if content and self.reply.ttft is None:
            self.reply.ttft = time.perf_counter() - self.started

    def _chat(self, event: dict) -> None:
        if "error" in event:
            self._fail(str(event["error"])[:200])
            return
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                self._first(content)
                self.pieces.append(content)
        usage = event.get("usage")
        if usage:
            reply = self.reply
            reply.prompt_tokens = usage.get("prompt_tokens") or 0
            reply.output_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            reply.cached_tokens = details.get("cached_tokens") or 0

    def _generate(self, event: dict) -> None:
        if "error" in event:
            self._fail(str(event["error"])[:200])
            return
        text = event.get("text") or ""
        self._first(text)
        self.pieces = [text]
        meta = event.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            self._fail(str(finish.get("message"))[:200])
        reply = self.reply
        reply.prompt_tokens = meta.get("prompt_tokens") or reply.prompt_tokens
        reply.cached_tokens = meta.get("cached_tokens") or reply.cached_tokens
        reply.output_tokens = meta.get("completion_tokens") or reply.output_tokens

    def _fail(self, message: str) -> None:
        if self.reply.error is None:
            self.reply.error = message

    def finish(self, status: int) -> Reply:
        reply = self.reply
        reply.latency = time.perf_counter() - self.started
        reply.status = status
        reply.text = "".join(self.pieces)
        if status != 200 and reply.error is None:
            reply.error = f"status {status}: {self.pending[:200]!r}"
        elif reply.error is None and not self.done:
            reply.error = "stream ended without [DONE]"
        elif reply.error is None and reply.ttft is None:
            reply.error = "no content"
        reply.ok = reply.error is None
        return reply


class _Protocol(asyncio.Protocol):
    def __init__(self, events: _Events, finished: asyncio.Future) -> None:
        self.events = events
        self.finished = finished
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._end(RuntimeError(f"bad HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(RuntimeError(f"connection lost: {exc or 'closed before the answer ended'}"))

    def on_body(self, body: bytes) -> None:
        if self.parser.get_status_code() == 200:
            self.events.feed(body)
        else:
            self.events.pending += body

    def on_message_complete(self) -> None:
        if not self.finished.done():
            self.finished.set_result(self.parser.get_status_code())
        if self.transport is not None:
            self.transport.close()

    def _end(self, exc: Exception) -> None:
        if not self.finished.done():
            self.finished.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


async def exchange(port: int, path: str, body: dict, timeout: float,
                   headers: dict[str, str] | None, events: _Events,
                   protocol: type[_Protocol] = _Protocol) -> int:
    """POST `body` to 127.0.0.1:port on a connection of its own, feeding the answer to
    `events` through `protocol`; the HTTP status, or 0 (the error noted in `events`)."""
    raw = orjson.dumps(body)
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n{extra}Connection: close\r\n\r\n").encode("ascii")
    loop = asyncio.get_running_loop()
    finished: asyncio.Future = loop.create_future()
    transport = None
    try:
        async with asyncio.timeout(timeout):
            transport, _ = await loop.create_connection(
                lambda: protocol(events, finished), HOST, port)
            transport.write(head + raw)
            return await finished
    except TimeoutError:
        events.reply.error = f"timeout after {timeout:.0f}s"
    except (OSError, RuntimeError) as exc:
        events.reply.error = str(exc)[:200]
    finally:
        if transport is not None:
            transport.close()
    return 0


async def stream(port: int, path: str, body: dict, timeout: float,
                 headers: dict[str, str] | None = None) -> Reply:
    """POST `body` (which asks for a stream) to 127.0.0.1:port and time its answer; `headers`
    are added as given (an API key, a priority class)."""
    events = _Events(path.endswith("/chat/completions"), time.perf_counter())
    status = await exchange(port, path, body, timeout, headers, events)
    return events.finish(status)
