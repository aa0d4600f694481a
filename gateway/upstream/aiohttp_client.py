"""The data path through aiohttp's client (`--upstream-client aiohttp`).

One `ClientSession` per process, opened by `start()` and closed by `close()`. Its connector
keeps at most `max_connections` per server (`limit_per_host`; no total cap, that is the
servers' sum) and waits in line for a free one up to `pool_timeout` seconds. Kept-alive
connections expire after 4 s, below the 5 s after which SGLang's uvicorn closes them, and a
connection is reused only when its transport is still open (aiohttp checks that when it takes
one from its pool), so a server's close of an idle connection is noticed before a request is
written to it. aiohttp never resends a POST: its one retry on a kept-alive connection that
fails before the response is limited to idempotent methods (`client.py`, IDEMPOTENT_METHODS,
RFC 9112 9.3.1), which is what the gateway needs: SGLang would answer a resent request with
400 "Duplicate request ID".

Bodies are not decompressed (`accept-encoding: identity`, `auto_decompress=False`): bytes are
relayed as the server sent them, each chunk handed over as it arrives (`readany`). `abort()`
closes the connection, which is how SGLang learns that the client left. aiohttp itself skips
1xx interim responses, reads close-delimited bodies to EOF, brackets IPv6 hosts and raises
`ClientPayloadError` for a body cut short.

Optional (`pip install 'pd-gateway[aiohttp]'`): imported only when chosen (`choices.py`).
Its errors are translated here into those of `errors.py`.
"""

from __future__ import annotations

import ssl
import time
from typing import TYPE_CHECKING

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from gateway.upstream.base import Body, UpstreamSettings
from gateway.upstream.errors import (
    ConnectFailed,
    ErrorTable,
    PoolTimeout,
    TransportError,
    UpstreamTimeout,
    mapped,
)
from gateway.upstream.http11_pool import IDLE_EXPIRY

if TYPE_CHECKING:
    import httpx

# most specific first: a ServerTimeoutError is a connection error and a TimeoutError, which
# must not pass for the caller's own deadline
ERRORS: ErrorTable = (
    (aiohttp.ServerTimeoutError, UpstreamTimeout),
    (aiohttp.ClientConnectorError, ConnectFailed),
    (aiohttp.ClientError, TransportError),
    (HttpProcessingError, TransportError),
)
LIBRARY_ERRORS = (aiohttp.ClientError, HttpProcessingError)


class _AiohttpResponse:
    __slots__ = ("_response", "_content", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self._content = response.content
        self.status = response.status

    def header(self, name: bytes) -> bytes | None:
        value = self._response.headers.get(name.decode())
        return value.encode("utf-8", "surrogateescape") if value is not None else None

    async def next_chunk(self) -> bytes | None:
        try:
            chunk = await self._content.readany()
        except LIBRARY_ERRORS as exc:
            raise mapped(exc, ERRORS) from exc
        if chunk:
            return chunk
        self._response.release()  # the whole body was read: the connection may be reused
        return None

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except LIBRARY_ERRORS as exc:
            raise mapped(exc, ERRORS) from exc

    def abort(self) -> None:
        self._response.close()  # closes the connection unless it was already released


class AiohttpUpstream:
    def __init__(self, connect_timeout: float, max_connections: int = 512,
                 pool_timeout: float = 30.0, tls: ssl.SSLContext | None = None,
                 user_agent: str = "pd-gateway") -> None:
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.pool_timeout = pool_timeout
        self.tls = tls
        self._headers = {"Content-Type": "application/json", "Accept-Encoding": "identity",
                         "User-Agent": user_agent}
        self.session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, str], URL] = {}  # parsed once: ~8 us a request less

    @classmethod
    async def open(cls, settings: UpstreamSettings,
                   control: httpx.AsyncClient) -> AiohttpUpstream:
        upstream = cls(settings.connect_timeout, settings.max_connections,
                       settings.pool_timeout, settings.tls)
        await upstream.start()
        return upstream

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=self.max_connections, keepalive_timeout=IDLE_EXPIRY,
            ssl=self.tls if self.tls is not None else True)
        # `connect` bounds the wait for a free connection plus connecting; `sock_connect`
        # the connect itself. Reads are bounded by the callers' own deadlines.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.pool_timeout,
                                        sock_connect=self.connect_timeout, sock_read=None)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(), raise_for_status=False)

    async def post(self, base_url: str, path: str, body: bytes | Body, request_id: str,
                   headers: tuple[tuple[str, str], ...] = ()) -> _AiohttpResponse:
        if self.session is None:
            await self.start()
        url = self._urls.get((base_url, path))
        if url is None:
            if len(self._urls) > 4096:  # servers come and go (discovery): stay bounded
                self._urls.clear()
            url = self._urls[base_url, path] = URL(base_url + path)
        sent = dict(self._headers)
        sent["X-Request-Id"] = request_id
        if headers:  # the trace context
            sent.update(headers)
        started = time.monotonic()
        try:
            data = bytes(body) if isinstance(body, Body) else body  # one buffer (a copy)
            response = await self.session.post(url, data=data, headers=sent,
                                               allow_redirects=False)
        except aiohttp.ConnectionTimeoutError as exc:
            if time.monotonic() - started + 0.02 >= self.pool_timeout:  # the wait, not connect
                raise PoolTimeout(
                    f"no connection to {base_url} within {self.pool_timeout:g}s "
                    f"({self.max_connections} in use: --upstream-max-connections)") from None
            raise ConnectFailed(f"connect to {base_url} timed out: {exc}") from None
        except LIBRARY_ERRORS as exc:
            raise mapped(exc, ERRORS) from exc
        return _AiohttpResponse(response)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
