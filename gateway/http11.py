"""A lean HTTP/1.1 client for the data path: keep-alive pool, streamed bodies, no copies.

Why not httpx here: each PD request makes two upstream requests, and httpx's layers
(request/response models, httpcore, anyio streams) cost more CPU than the rest of the
gateway together (measured in docs/BENCHMARKS.md). This client does only what the two legs
need: POST a prepared body, read the status and headers, then hand body chunks over as they
arrive. httpx stays in use for the control path (probes, health, info), where cost is moot.

Parsing uses httptools (already installed with uvicorn[standard]). A connection goes back to
its pool only after a complete response with keep-alive; an abandoned response (cancelled,
timed out, failed) closes its connection, which is also how the server learns the client left.
"""

from __future__ import annotations

import asyncio
import collections
import time
from urllib.parse import urlsplit

import httptools

IDLE_EXPIRY = 4.0  # below uvicorn's default keep-alive timeout (5 s): SGLang closes at 5 s
HIGH_WATER = 1 << 20  # pause reading when this many body bytes wait unconsumed


class HTTPClientError(Exception):
    """Base of data-path client errors (mapped to UpstreamError by the caller)."""


class ConnectFailed(HTTPClientError):
    pass


class ConnectionLost(HTTPClientError):
    """The server closed or reset the connection before the response was complete."""

    def __init__(self, message: str, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class ProtocolViolation(HTTPClientError):
    pass


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.reused = False
        self.closed = False
        self._response: Response | None = None

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._response is None:  # bytes while idle: the server is misbehaving
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolViolation(f"bad HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is not None and not response.complete:
            self._fail(ConnectionLost(
                f"connection closed by the server ({exc or 'EOF'})",
                before_response=not response.started))
        self.pool.discard(self)

    def pause_writing(self) -> None:  # request bodies are small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._response is not None:
            self._response.started = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self._response
        response.status = self.parser.get_status_code()
        response.keep_alive = self.parser.should_keep_alive()
        if not response.head.done():
            response.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._response.feed(body)

    def on_message_complete(self) -> None:
        response = self._response
        response.complete = True
        response.feed(None)
        if not response.keep_alive:
            self.close()

    # -- helpers --------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        response = self._response
        if response is not None:
            response.fail(exc)

    def start(self, response: Response, request: bytes) -> None:
        self._response = response
        response.connection = self
        self.transport.write(request)

    def finish(self) -> None:
        """The response was fully read: back to the pool, or closed."""
        response, self._response = self._response, None
        if self.closed or response is None or not response.complete or not response.keep_alive:
            self.close()
            return
        self.parser = httptools.HttpResponseParser(self)
        self.reused = True
        self.idle_since = time.monotonic()
        self.pool.release(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self.pool.discard(self)


class Response:
    """Status, headers and a body delivered in chunks as the server sends them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.head: asyncio.Future[None] = loop.create_future()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.started = False
        self.complete = False
        self.connection: _Connection | None = None
        self._chunks: collections.deque[bytes | None] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        self._loop = loop
        self._paused = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    # producer side (the connection)
    def feed(self, chunk: bytes | None) -> None:
        self._chunks.append(chunk)
        if chunk:
            self._buffered += len(chunk)
            if self._buffered > HIGH_WATER and not self._paused and self.connection:
                self._paused = True
                self.connection.transport.pause_reading()
        self._wake()

    def fail(self, exc: Exception) -> None:
        self._error = exc
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # mark retrieved: a caller may never await it
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # consumer side
    async def next_chunk(self) -> bytes | None:
        """The next body chunk, or None at the end of the body."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._waiter
            self._waiter = None
        chunk = self._chunks.popleft()
        if chunk is None:
            self.release()
            return None
        if self._chunks and self._chunks[0] is not None:
            # several reads arrived while the consumer was busy: hand them over in one piece,
            # so the relay writes once to the client instead of once per read
            parts = [chunk]
            while self._chunks and self._chunks[0] is not None:
                parts.append(self._chunks.popleft())
            chunk = b"".join(parts)
        self._buffered -= len(chunk)
        if self._paused and self._buffered < HIGH_WATER // 2:
            self._paused = False
            self.connection.transport.resume_reading()
        return chunk

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with this response: reuse the connection if the body was read to the end."""
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.finish()

    def abort(self) -> None:
        """Give up on the response: the connection closes, the server sees a disconnect."""
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.close()


class _HostPool:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.idle: collections.deque[_Connection] = collections.deque()
        self.active: set[_Connection] = set()

    def release(self, connection: _Connection) -> None:
        self.active.discard(connection)
        self.idle.append(connection)

    def discard(self, connection: _Connection) -> None:
        self.active.discard(connection)
        try:
            self.idle.remove(connection)
        except ValueError:
            pass

    def take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self.idle:
            connection = self.idle.pop()  # most recently used first: warmest
            if connection.closed or now - connection.idle_since > IDLE_EXPIRY:
                connection.close()
                continue
            self.active.add(connection)
            return connection
        return None


class HTTPClient:
    """Pools per host:port. `request()` returns once the status line and headers arrived."""

    def __init__(self, connect_timeout: float = 5.0, user_agent: str = "pd-gateway") -> None:
        self.connect_timeout = connect_timeout
        self.user_agent = user_agent.encode()
        self._pools: dict[str, _HostPool] = {}

    def _pool(self, base_url: str) -> _HostPool:
        pool = self._pools.get(base_url)
        if pool is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http":
                raise ProtocolViolation(f"the data-path client speaks plain http only: {base_url}")
            pool = self._pools[base_url] = _HostPool(parts.hostname, parts.port or 80)
        return pool

    async def _connect(self, pool: _HostPool) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(pool), pool.host, pool.port)
        except TimeoutError:
            raise ConnectFailed(f"connect to {pool.host}:{pool.port} timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {pool.host}:{pool.port}: {exc}") from None
        pool.active.add(connection)
        return connection

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: bytes = b"") -> Response:
        """POST `body`; `headers` are extra raw header lines, each ending in CRLF."""
        pool = self._pool(base_url)
        head = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + pool.host.encode()
                + b":" + str(pool.port).encode() + b"\r\nUser-Agent: " + self.user_agent
                + b"\r\nContent-Type: application/json\r\nAccept-Encoding: identity"
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + headers
                + b"\r\n")
        request = head + body
        loop = asyncio.get_running_loop()
        while True:
            connection = pool.take_idle()
            reused = connection is not None
            if connection is None:
                connection = await self._connect(pool)
            response = Response(loop)
            connection.start(response, request)
            try:
                await response.head
                return response
            except ConnectionLost as exc:
                # a kept-alive connection the server closed just before our request: retry
                # once on a fresh one (nothing of the response came, nothing was processed)
                if reused and exc.before_response:
                    continue
                raise
            except BaseException:
                response.abort()
                raise

    def close(self) -> None:
        for pool in self._pools.values():
            for connection in list(pool.idle) + list(pool.active):
                connection.close()
        self._pools.clear()

    def stats(self) -> dict[str, dict[str, int]]:
        return {url: {"idle": len(p.idle), "active": len(p.active)}
                for url, p in self._pools.items()}
