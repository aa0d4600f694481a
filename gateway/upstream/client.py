"""Upstream clients and the translation of their errors at the boundary.

Three data-path clients behind one small interface (`Upstream.post` -> `UpstreamResponse`),
chosen by `--upstream-client` (see docs/ARCHITECTURE.md, "Data-path client"):

* `FastUpstream` ("fast", default): the lean keep-alive client of `http11.py`;
* `AiohttpUpstream` ("aiohttp"): aiohttp's client (`aiohttp_upstream.py`);
* `HttpxUpstream` ("httpx"): httpx, also used in unit tests (`httpx.MockTransport`).

All three verify https servers against `--upstream-ca-file` (default: the system store) unless
`--upstream-insecure`, and keep at most `--upstream-max-connections` per server.
`build_client` makes the process's one httpx client (probes, health, info, admin).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable
from typing import Protocol

import aiohttp
import httpx
import orjson
from aiohttp.http_exceptions import HttpProcessingError

from gateway.errors import UpstreamError
from gateway.servers.pool import Server
from gateway.upstream.http11 import ConnectFailed, HTTPClient, HTTPClientError, PoolTimeout

log = logging.getLogger("gateway")

RETRYABLE_STATUSES = frozenset({408, 429})


class UpstreamResponse(Protocol):
    status: int

    def header(self, name: bytes) -> bytes | None: ...

    async def next_chunk(self) -> bytes | None: ...

    async def read(self) -> bytes: ...

    def abort(self) -> None: ...


class Upstream(Protocol):
    async def post(self, base_url: str, path: str, body: bytes, request_id: str,
                   headers: tuple[tuple[str, str], ...] = ()) -> UpstreamResponse: ...
    # `headers`: more request headers (the trace context), names and values already checked

    async def close(self) -> None: ...


def ssl_context(ca_file: str | None = None, insecure: bool = False) -> ssl.SSLContext:
    """The TLS settings of every upstream client: verify against `ca_file` (default: the
    system store), or not at all when `insecure`."""
    context = ssl.create_default_context(cafile=ca_file)
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class FastUpstream:
    def __init__(self, connect_timeout: float, max_connections: int = 512,
                 pool_timeout: float = 30.0, tls: ssl.SSLContext | None = None) -> None:
        self.client = HTTPClient(connect_timeout, limit=max_connections,
                                 pool_timeout=pool_timeout, ssl_context=tls)

    def post(self, base_url: str, path: str, body: bytes, request_id: str,
             headers: tuple[tuple[str, str], ...] = ()) -> Awaitable[UpstreamResponse]:
        """The client's own coroutine, not one more layer around it (twice per request)."""
        lines = b"X-Request-Id: " + request_id.encode() + b"\r\n"
        if headers:
            lines += b"".join(b"%s: %s\r\n" % (name.encode(), value.encode())
                              for name, value in headers)
        return self.client.post(base_url, path, body, lines)

    async def close(self) -> None:
        self.client.close()


class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        if response.is_stream_consumed:  # an in-memory body (MockTransport answers)
            self._chunks = _once(response.content)
        else:
            self._chunks = response.aiter_raw()

    def header(self, name: bytes) -> bytes | None:
        value = self._response.headers.get(name.decode())
        return value.encode() if value is not None else None

    async def next_chunk(self) -> bytes | None:
        async for chunk in self._chunks:
            if chunk:
                return chunk
        await self._response.aclose()
        return None

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def abort(self) -> None:
        # closing an httpx stream needs an await; the connection is dropped when collected
        stream = self._response.stream
        close = getattr(stream, "aclose", None)
        if close is not None:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().create_task(close())


async def _once(data: bytes):
    yield data


class HttpxUpstream:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, base_url: str, path: str, body: bytes, request_id: str,
                   headers: tuple[tuple[str, str], ...] = ()) -> UpstreamResponse:
        request = self.client.build_request(
            "POST", base_url + path, content=body,
            headers={"content-type": "application/json", "accept-encoding": "identity",
                     "x-request-id": request_id, **dict(headers)})
        return _HttpxResponse(await self.client.send(request, stream=True))

    async def close(self) -> None:
        pass


def build_client(
    connect_timeout: float,
    max_connections: int,
    transport: httpx.AsyncBaseTransport | None = None,
    tls: ssl.SSLContext | None = None,
) -> httpx.AsyncClient:
    """The process's httpx client. Reads are bounded by callers' own deadlines."""
    timeout = httpx.Timeout(connect=connect_timeout, read=None, write=connect_timeout,
                            pool=connect_timeout)
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections, keepalive_expiry=4)
    return httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport,
                             verify=tls if tls is not None else True,
                             follow_redirects=False, trust_env=False)


class translate_errors:  # lower case: used as a context manager
    """Turn client and transport errors into an UpstreamError naming the leg and server.

    A class, not a generator context manager: it wraps four awaits per request."""

    __slots__ = ("leg", "server")

    def __init__(self, leg: str, server: Server) -> None:
        self.leg = leg
        self.server = server

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        error = translated(self.leg, self.server.url, exc)
        if error is None:
            return False
        raise error from exc


def translated(leg: str, url: str, exc: Exception) -> UpstreamError | None:
    """The UpstreamError for a client or transport error (None: let it pass as it is)."""
    if isinstance(exc, PoolTimeout | httpx.PoolTimeout):
        return UpstreamError(f"{leg} server {url} is busy: {exc}", leg=leg, server_url=url,
                             retryable=True, status=503)
    if isinstance(exc, aiohttp.ServerTimeoutError):  # a TimeoutError, not the caller's own
        return UpstreamError(f"{leg} server {url} timed out ({type(exc).__name__})",
                             leg=leg, server_url=url, retryable=True, status=504)
    if isinstance(exc, TimeoutError):
        return None  # the caller's own deadline: it knows which timeout and answers 504
    if isinstance(exc, httpx.ConnectError | ConnectFailed | aiohttp.ClientConnectorError):
        return UpstreamError(f"{leg} server {url} refused or dropped the connection: {exc}",
                             leg=leg, server_url=url, retryable=True)
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(f"{leg} server {url} timed out ({type(exc).__name__})",
                             leg=leg, server_url=url, retryable=True, status=504)
    if isinstance(exc, httpx.HTTPError | HTTPClientError | aiohttp.ClientError
                  | HttpProcessingError | OSError):
        return UpstreamError(f"{leg} server {url} failed: {type(exc).__name__}: {exc}",
                             leg=leg, server_url=url, retryable=True)
    return None


def upstream_message(body: bytes) -> str:
    """The human part of an error answer from SGLang (OpenAI error, FastAPI detail, or text)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return str(data)[:500]


def status_error(leg: str, server: Server, status: int, body: bytes) -> UpstreamError:
    """An error for an HTTP status >= 400 from a leg.

    4xx (but 408/429) means the request itself was refused: pass the status through and do
    not retry. 408, 429 and 5xx are the server's trouble: retryable, 502 if they persist.
    """
    message = f"{leg} server {server.url} answered {status}: {upstream_message(body)}"
    if 400 <= status < 500 and status not in RETRYABLE_STATUSES:
        return UpstreamError(message, leg=leg, server_url=server.url, retryable=False,
                             upstream_status=status, status=status)
    return UpstreamError(message, leg=leg, server_url=server.url, retryable=True,
                         upstream_status=status, status=502)
