"""uvicorn's httptools protocol, with one send() per response and disconnect callbacks.

One send() per response: uvicorn writes a response's status line and headers as soon as the app sends
`http.response.start`, and the body on `http.response.body`: two loopback
`send()` calls per small answer. Profiles of a busy PD pair showed those two
syscalls as ~30% of each sim's CPU (a loopback send also does the receiver's
TCP work). This protocol hands uvicorn a transport that queues the writes of
one loop iteration and sends them together at its end (one `call_soon` per
batch), so head and body leave in one segment.

Disconnect callbacks: a non-streaming request learns that its client left
only by awaiting `receive()`, which needs a watcher task per request (~8 us
to start and cancel). The protocol puts itself in the scope under
`DISCONNECT_SCOPE_KEY`; the app adds a callback to `on_disconnect` for as
long as it has no answer, and the protocol calls it when the connection is
lost. Apps served by another server fall back to the watcher task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """Wraps a transport: writes wait for the end of the loop iteration."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def writelines(self, chunks: list[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


DISCONNECT_SCOPE_KEY = "sim.connection"


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """`uvicorn.Config(http=CoalescingHttpToolsProtocol)`: httptools, coalesced writes."""

    on_disconnect: set[Callable[[], None]]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.on_disconnect = set()
        super().connection_made(
            CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def on_headers_complete(self) -> None:
        self.scope[DISCONNECT_SCOPE_KEY] = self  # type: ignore[literal-required]
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        callbacks, self.on_disconnect = self.on_disconnect, set()
        for callback in callbacks:
            callback()
