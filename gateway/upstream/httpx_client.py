"""httpx: the control-path client of every process, and the "httpx" data-path adapter.

`build_client` makes the process's one httpx client (probes, health, info, admin, aborts).
`HttpxUpstream` sends legs through it: with `--upstream-client httpx`, and in unit tests,
whose `httpx.MockTransport` stands in for the servers. Its errors are translated here into
those of `errors.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import httpx

from gateway.upstream.base import Body, UpstreamResponse, UpstreamSettings
from gateway.upstream.errors import (
    ConnectFailed,
    ErrorTable,
    PoolTimeout,
    TransportError,
    UpstreamTimeout,
    mapped,
)

# most specific first: httpx.PoolTimeout and httpx.ConnectTimeout are TimeoutExceptions
ERRORS: ErrorTable = (
    (httpx.PoolTimeout, PoolTimeout),
    (httpx.ConnectError, ConnectFailed),
    (httpx.TimeoutException, UpstreamTimeout),
    (httpx.HTTPError, TransportError),
)


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
        try:
            async for chunk in self._chunks:
                if chunk:
                    return chunk
            await self._response.aclose()
        except httpx.HTTPError as exc:
            raise mapped(exc, ERRORS) from exc
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

    @classmethod
    async def open(cls, settings: UpstreamSettings, control: httpx.AsyncClient) -> HttpxUpstream:
        """Legs share the control client (its limits are `--max-connections`)."""
        return cls(control)

    async def post(self, base_url: str, path: str, body: bytes | Body, request_id: str,
                   headers: tuple[tuple[str, str], ...] = ()) -> UpstreamResponse:
        request = self.client.build_request(
            "POST", base_url + path, content=bytes(body) if isinstance(body, Body) else body,
            headers={"content-type": "application/json", "accept-encoding": "identity",
                     "x-request-id": request_id, **dict(headers)})
        try:
            return _HttpxResponse(await self.client.send(request, stream=True))
        except httpx.HTTPError as exc:
            raise mapped(exc, ERRORS) from exc

    async def close(self) -> None:
        pass
