"""The default data-path client ("fast"): the lean keep-alive client of `http11.py`.

That client raises the errors of `errors.py` itself, so nothing is translated here: `post`
returns its coroutine as is (two legs per request make one more layer measurable).
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from gateway.upstream.base import Body, UpstreamResponse, UpstreamSettings
from gateway.upstream.http11 import HTTPClient

if TYPE_CHECKING:
    import httpx


class FastUpstream:
    def __init__(self, connect_timeout: float, max_connections: int = 512,
                 pool_timeout: float = 30.0, tls: ssl.SSLContext | None = None) -> None:
        self.client = HTTPClient(connect_timeout, limit=max_connections,
                                 pool_timeout=pool_timeout, ssl_context=tls)

    @classmethod
    async def open(cls, settings: UpstreamSettings, control: httpx.AsyncClient) -> FastUpstream:
        return cls(settings.connect_timeout, settings.max_connections, settings.pool_timeout,
                   settings.tls)

    def post(self, base_url: str, path: str, body: bytes | Body, request_id: str,
             headers: tuple[tuple[str, str], ...] = ()) -> Awaitable[UpstreamResponse]:
        """The client's own coroutine, not one more layer around it (twice per request)."""
        lines = b"X-Request-Id: " + request_id.encode() + b"\r\n"
        if headers:
            lines += b"".join(b"%s: %s\r\n" % (name.encode(), value.encode())
                              for name, value in headers)
        return self.client.post(base_url, path, body, lines)

    async def close(self) -> None:
        self.client.close()
