"""A lean HTTP/1.1 client for the data path: keep-alive pool, streamed bodies, no copies
of a large request body (its parts are written as they are: `base.Body`).

Why not a library here: each PD request makes two upstream requests, and the client is a
large share of the gateway's CPU per request. In `loadtests.overhead` the gateway on aiohttp's
client (same llhttp parser) costs 1.8-2.4x the CPU per request of the gateway on this one, on
httpx 57-68x (docs/BENCHMARKS.md, "Data-path client"). This client does only what the two legs
need: POST a prepared body, read the status and headers, then hand body chunks over as they
arrive. httpx stays for the control path (probes, health, info), where cost is moot; aiohttp
is the `--upstream-client aiohttp` alternative.

Parsing uses httptools (installed with uvicorn[standard]). What it handles, each with a
socket-level test in tests/upstream/:

* http and https (an `ssl.SSLContext`: verification by default), IPv6 literal hosts
  (connected by address, `Host: [::1]:port`);
* at most `limit` connections per server, further requests wait in line (`http11_pool.py`);
* 1xx interim responses (100 Continue, 103 Early Hints) are skipped;
* bodies by Content-Length, chunked (extensions and trailers ignored) or, without either,
  delimited by the server's close; a body cut short is an error, never a short success;
* a cap on the response head (status line + headers) so a broken server cannot make it grow;
* a POST is never sent twice: an idle connection the server already closed is noticed before
  the request is written and another one is used; once written, any failure is the caller's
  to handle (SGLang would answer a resent request 400 "Duplicate request ID");
* a connection goes back to its pool only after a complete response with keep-alive; an
  abandoned response (cancelled, timed out, failed, half-read) closes its connection, which is
  also how the server learns the client left.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import urlsplit

import httptools

from gateway.upstream.base import Body
from gateway.upstream.errors import (
    ConnectFailed,
    ConnectionLost,
    PoolTimeout,
    ProtocolViolation,
    TransportError,
)
from gateway.upstream.http11_pool import HostPool

HIGH_WATER = 1 << 20  # pause reading when this many body bytes wait unconsumed
JOIN_BELOW = 64 * 1024  # bodies up to this size are copied behind the head: one write
MAX_HEAD = 64 * 1024  # bytes of status lines + headers (1xx included) before giving up
NO_BODY_STATUSES = frozenset({204, 304})


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    def __init__(self, pool: HostPool[_Connection]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()  # once, not per post: it costs a getpid
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.closed = False
        self.dirty = False  # bytes beyond the response: never reuse
        self._response: Response | None = None
        self._head_bytes = 0

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None or response.complete:  # bytes nobody asked for
            self.dirty = True
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, TransportError)
                       else ProtocolViolation(f"bad HTTP response: {exc}"))
            self.close()
            return
        if response.status == 0:  # still in the head
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self._fail(ProtocolViolation(f"response head over {MAX_HEAD} bytes"))
                self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is not None and not response.complete:
            if exc is None and response.status and response.until_close:
                response.complete = True  # the close delimits this body: it is whole
                response.feed(None)
            else:
                response.fail(ConnectionLost(
                    f"connection closed by the server ({exc or 'EOF'})",
                    before_response=response.status == 0))
        self.pool.discard(self)

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._response.complete:  # a second response to one request
            self.dirty = True

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        if response.status:
            return  # a trailer (after a chunked body): ignored
        name = name.lower()
        if name == b"content-length":
            response.until_close = False
        elif name == b"transfer-encoding" and value.rstrip().lower().endswith(b"chunked"):
            response.until_close = False
        response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._response
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                raise ProtocolViolation("unexpected 101 Switching Protocols")
            response.headers.clear()  # interim (100 Continue, 103 Early Hints): skipped
            response.until_close = True
            response.interim = True
            return
        response.status = status
        response.keep_alive = self.parser.should_keep_alive()
        if status in NO_BODY_STATUSES:
            response.until_close = False
        if not response.head.done():
            response.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._response.feed(body)

    def on_message_complete(self) -> None:
        response = self._response
        if response.interim:
            response.interim = False
            return
        if response.complete:
            return
        response.complete = True
        response.feed(None)
        if not response.keep_alive:
            self.close()

    # -- helpers --------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        response = self._response
        if response is not None:
            response.fail(exc)

    def start(self, response: Response, request: bytes,
              parts: tuple[bytes | memoryview, ...] = ()) -> None:
        """Send the request: its head (with the body when small), then the body's parts as
        they are (uvloop's transport keeps a reference to a large buffer, no copy)."""
        self._response = response
        self._head_bytes = 0
        response.connection = self
        if parts:
            self.transport.writelines((request, *parts))
        else:
            self.transport.write(request)

    def finish(self) -> None:
        """The response was fully read: back to the pool, or closed."""
        response, self._response = self._response, None
        if self.closed or self.dirty or response is None or not response.complete \
                or not response.keep_alive:
            self.close()
            return
        self.pool.release(self)  # (the parser, reset by llhttp after each message, stays)

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
        self.status = 0  # set once the final (non-1xx) head is in
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.until_close = True  # no Content-Length, not chunked: the body ends at EOF
        self.interim = False
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
            if self.connection is not None:
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
            if self._paused and not connection.closed:
                self._paused = False
                connection.transport.resume_reading()
            connection.finish()

    def abort(self) -> None:
        """Give up on the response: the connection closes, the server sees a disconnect."""
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.close()


class HTTPClient:
    """Pools per server URL. `post()` returns once the status line and headers arrived."""

    def __init__(self, connect_timeout: float = 5.0, user_agent: str = "pd-gateway",
                 limit: int = 512, pool_timeout: float = 30.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.user_agent = user_agent.encode()
        self.limit = limit
        self.pool_timeout = pool_timeout
        self.ssl_context = ssl_context
        self._pools: dict[str, HostPool[_Connection]] = {}

    def _pool(self, base_url: str) -> HostPool[_Connection]:
        pool = self._pools.get(base_url)
        if pool is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ProtocolViolation(f"not an http(s) server URL: {base_url}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            authority = parts.netloc.rpartition("@")[2]  # brackets kept for IPv6
            pool = HostPool(parts.hostname, port, authority, self.limit)
            if tls:
                pool.tls = self.ssl_context or ssl.create_default_context()
            self._pools[base_url] = pool
        return pool

    async def _acquire(self, pool: HostPool[_Connection]) -> _Connection:
        """A live connection to the pool's server: idle, new, or after waiting in line."""
        while True:
            connection = pool.take_idle()
            if connection is not None:
                return connection
            if pool.size < pool.limit:
                pool.pending += 1
                return await self._connect(pool)
            try:
                got = await pool.wait(self.pool_timeout)
            except TimeoutError:
                raise PoolTimeout(
                    f"no free connection to {pool.authority} within {self.pool_timeout:g}s "
                    f"({pool.limit} in use: --upstream-max-connections)") from None
            if got is None:  # a place was promised to us (already in pending)
                return await self._connect(pool)
            if not got.closed:
                return got

    async def _connect(self, pool: HostPool[_Connection]) -> _Connection:
        """Open a connection on a place already counted in `pool.pending`."""
        loop = asyncio.get_running_loop()
        tls = pool.tls
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(pool), pool.host, pool.port, ssl=tls,
                    server_hostname=pool.host if tls else None)
        except BaseException as exc:
            pool.pending -= 1
            pool.freed()
            if isinstance(exc, TimeoutError):
                raise ConnectFailed(f"connect to {pool.authority} timed out") from None
            if isinstance(exc, OSError):  # ssl.SSLError included: a refused certificate
                raise ConnectFailed(f"cannot connect to {pool.authority}: {exc}",
                                    cause=type(exc).__name__) from None
            raise
        pool.pending -= 1
        pool.active.add(connection)
        if connection.closed:  # lost while the handshake finished: counted, then let go
            pool.discard(connection)
            raise ConnectFailed(f"connection to {pool.authority} closed at once")
        return connection

    async def post(self, base_url: str, path: str, body: bytes | Body,
                   headers: bytes = b"") -> Response:
        """POST `body`; `headers` are extra raw header lines, each ending in CRLF.

        Sent once: a failure after the request was written is raised, never resent."""
        pool = self._pool(base_url)
        head = pool.heads.get(path)
        if head is None:  # the same for every request to this server and path
            head = pool.heads[path] = (
                b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + pool.authority.encode()
                + b"\r\nUser-Agent: " + self.user_agent
                + b"\r\nContent-Type: application/json\r\nAccept-Encoding: identity"
                + b"\r\nContent-Length: ")
        if isinstance(body, Body):
            size, parts = body.size, body.parts
        else:
            size, parts = len(body), (body,)
        request = b"%s%d\r\n%s\r\n" % (head, size, headers)
        if size <= JOIN_BELOW:  # one buffer, one write: cheaper than a vector this small
            request = b"".join((request, *parts))
            parts = ()
        connection = pool.take_idle()  # the usual case, without a coroutine for _acquire
        if connection is None:
            connection = await self._acquire(pool)
        response = Response(connection.loop)
        connection.start(response, request, parts)
        try:
            await response.head
        except BaseException:
            response.abort()
            raise
        return response

    def close(self) -> None:
        for pool in self._pools.values():
            pool.fail_waiters(ConnectFailed("the client is closed"))
            for connection in list(pool.idle) + list(pool.active):
                connection.close()
        self._pools.clear()

    def stats(self) -> dict[str, dict[str, int]]:
        return {url: pool.stats() for url, pool in self._pools.items()}
