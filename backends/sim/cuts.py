"""Answers that break after they started: a 200 cut off mid-body, or one that stops sending.

Both faults act on the bytes an answer writes, so they wrap the endpoint's ASGI app and
judge each `send`; the app itself runs unchanged (its items complete, its rooms are used).

truncate_rate P  a fraction P of the 200 answers is cut off and the connection closed:
                 mirrors a server process or a proxy in front of it dying mid-write (OOM kill,
                 a crashed worker, an L4 balancer's idle reset). A JSON answer keeps its full
                 Content-Length and sends half its bytes; a stream sends 0-3 whole chunks,
                 then half of the next `data: {...}` line.
stall_after N    every 200 answer stops after N stream chunks with the connection left open,
                 no further bytes: mirrors a wedged server (a deadlocked detokenizer, a GPU
                 hang after the head was written) whose kernel still keeps the socket. A JSON
                 answer sends its head and half its body, then stops.
The connection ends only when the client closes it.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backends.sim.httpproto import DISCONNECT_SCOPE_KEY
from backends.sim.state import SimState


def shape(state: SimState, app: ASGIApp, endpoint: str) -> ASGIApp:
    """`app`, or `app` wrapped to break its answer if a cut fault applies to this request."""
    f = state.config.faults
    if f.truncate_rate > 0 and state.rng.random() < f.truncate_rate:
        return _Cut(app, state, endpoint, "truncated", good=state.rng.randint(0, 3))
    if f.stall_after > 0:
        return _Cut(app, state, endpoint, "stalled", good=f.stall_after)
    return app


class _Cut:
    """Pass the head and `good` body messages of a 200 answer, then break it.

    "truncated": send half of the next message and close the socket.
    "stalled":   send nothing more (a JSON answer: half its body first) and hold the socket.
    A non-200 answer passes untouched: the fault is a broken success.
    """

    def __init__(self, app: ASGIApp, state: SimState, endpoint: str, how: str,
                 good: int) -> None:
        self.app, self.state, self.endpoint, self.how, self.good = app, state, endpoint, how, good
        self.status = 0
        self.streamed = False
        self.broken = False
        self.gone = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection = scope.get(DISCONNECT_SCOPE_KEY)
        if connection is not None:
            connection.on_disconnect.add(self.gone.set)
        self.connection = connection

        async def cutting_send(message: Message) -> None:
            await self._send(message, send)
        await self.app(scope, receive, cutting_send)

    async def _send(self, message: Message, send: Send) -> None:
        if self.broken:
            await self.gone.wait()  # what the app writes after the cut never leaves
            return
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.streamed = all(name != b"content-length" for name, _ in message["headers"])
            await send(message)
            return
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if self.status != 200 or (not body and more):
            await send(message)
            return
        if self.streamed and self.good > 0 and more:
            self.good -= 1
            await send(message)
            return
        await self._break(body, send)

    async def _break(self, body: bytes, send: Send) -> None:
        self.broken = True
        self.state.stats.faulted(self.how)
        if not self.streamed or self.how == "truncated":
            await send({"type": "http.response.body", "body": _half(body), "more_body": True})
        if self.how == "truncated" and self.connection is not None:
            self.connection.transport.close()  # flushes the half first
        await self.gone.wait()


def _half(body: bytes) -> bytes:
    """The first half of the first line of `body`, at least into a `data: {` line's JSON."""
    line = body.split(b"\n", 1)[0]
    head = len(b"data: {") + 1 if line.startswith(b"data: {") else 1
    return line[:max(head, len(line) // 2)]
