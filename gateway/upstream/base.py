"""The interface of a data-path client: `Upstream.post` -> `UpstreamResponse`.

An adapter (`fast.py`, `aiohttp_client.py`, `httpx_client.py`, chosen by name in
`choices.py`) only turns a POST into a streamed response and raises the errors of `errors.py`;
what an error means for the request (retry, status) is decided at the boundary (`client.py`).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import httpx


class Body:
    """A request body in parts, sent one after the other and never joined: a leg's own head,
    then the encoding its request shares with its other leg and its retries
    (gateway/dispatch/leg_bodies.py). `bytes(body)` joins them, for a client that needs one
    buffer (a copy, made per leg)."""

    __slots__ = ("parts", "size")

    def __init__(self, *parts: bytes | memoryview) -> None:
        self.parts = parts
        self.size = sum(map(len, parts))

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


class UpstreamResponse(Protocol):
    status: int

    def header(self, name: bytes) -> bytes | None: ...

    async def next_chunk(self) -> bytes | None: ...

    async def read(self) -> bytes: ...

    def abort(self) -> None: ...


class Upstream(Protocol):
    async def post(self, base_url: str, path: str, body: bytes | Body, request_id: str,
                   headers: tuple[tuple[str, str], ...] = ()) -> UpstreamResponse: ...
    # `headers`: more request headers (the trace context), names and values already checked

    async def close(self) -> None: ...


@dataclass(frozen=True)
class UpstreamSettings:
    """What every data-path client is built from (`--upstream-*`, `--connect-timeout`)."""

    connect_timeout: float = 5.0
    max_connections: int = 512  # per server; more legs wait in line
    pool_timeout: float = 30.0  # seconds a leg may wait for a free connection
    tls: ssl.SSLContext | None = None  # https servers (default: the system's trust store)


class UpstreamClass(Protocol):
    """An adapter class as the name table (`choices.py`) resolves it."""

    @classmethod
    async def open(cls, settings: UpstreamSettings,
                   control: httpx.AsyncClient) -> Upstream: ...


def ssl_context(ca_file: str | None = None, insecure: bool = False) -> ssl.SSLContext:
    """The TLS settings of every upstream client: verify against `ca_file` (default: the
    system store), or not at all when `insecure`."""
    context = ssl.create_default_context(cafile=ca_file)
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
