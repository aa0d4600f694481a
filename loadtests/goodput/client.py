"""One streamed chat request with its objectives, timed from the client's side.

The routing benchmark's client (`loadtests/routing/client.py`: raw asyncio, httptools, one
connection per request) with two more readings: the time of the last content chunk and the
number of content chunks, for the mean inter-token latency (the mean gap between content
chunks after the first: (last - first) / (chunks - 1)), and whether the answer carried a
`Retry-After` header (a refusal that tells the client when to come back).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from loadtests.routing.client import _Events, _Protocol, exchange

REFUSED = (429, 503)  # statuses that count as refused early (not served, not attained)


@dataclass(frozen=True)
class Outcome:
    status: int  # 0: no HTTP answer
    ok: bool
    error: str | None
    ttft: float | None  # seconds to the first content chunk
    itl: float | None  # mean seconds between content chunks after the first
    chunks: int  # content chunks received
    latency: float  # seconds to the end of the answer
    retry_after: bool  # the answer had a Retry-After header

    @property
    def refused(self) -> bool:
        return self.status in REFUSED


class _TimedEvents(_Events):
    """Also notes when each content chunk came and whether Retry-After was sent."""

    def __init__(self, chat: bool, started: float) -> None:
        super().__init__(chat, started)
        self.chunks = 0
        self.last: float | None = None
        self.retry_after = False

    def _first(self, content: str) -> None:
        super()._first(content)
        if content:
            self.chunks += 1
            self.last = time.perf_counter()


class _HeaderProtocol(_Protocol):
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"retry-after":
            self.events.retry_after = True  # type: ignore[attr-defined]


def outcome(events: _TimedEvents, status: int) -> Outcome:
    reply = events.finish(status)
    itl = None
    if reply.ttft is not None and events.last is not None and events.chunks > 1:
        first = events.started + reply.ttft
        itl = (events.last - first) / (events.chunks - 1)
    return Outcome(status, reply.ok, reply.error, reply.ttft, itl, events.chunks,
                   reply.latency, events.retry_after)


async def send(port: int, path: str, body: dict, headers: dict[str, str],
               timeout: float) -> Outcome:
    """POST a streamed `body` with `headers` to 127.0.0.1:port; its timed outcome."""
    events = _TimedEvents(path.endswith("/chat/completions"), time.perf_counter())
    status = await exchange(port, path, body, timeout, headers, events, _HeaderProtocol)
    return outcome(events, status)
