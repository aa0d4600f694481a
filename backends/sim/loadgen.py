"""A lean closed-loop PD load generator: raw asyncio keep-alive HTTP/1.1.

Used by `backends.sim.bench`. It shares one core with the two sims it
drives, so every microsecond it spends is taken from them: no HTTP library,
one protocol object per connection, httptools to parse answers, request
bytes built by one `%` format, and a full JSON check of only every
`check_every`-th pair (status codes are checked on every answer).

Each of `pairs` workers owns one connection to the prefill and one to the
decode and loops: send the same body (a fresh bootstrap room) to both, wait
for both answers, record the pair's latency.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httptools
import orjson


class HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 client connection with one request in flight."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.chunks: list[bytes] = []

    @classmethod
    async def open(cls, host: str, port: int) -> HttpConnection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, host, port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"bad HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError("connection closed by the server"))

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        body, self.chunks = b"".join(self.chunks), []
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), body))

    def request(self, raw: bytes) -> asyncio.Future[tuple[int, bytes]]:
        """Send one whole request; the future gets (status, body)."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("connection is closed")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@dataclass
class Results:
    """What the workers saw inside the measuring window."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    checked: int = 0
    recording: bool = False
    stopping: bool = False

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(text[:300])


@dataclass(frozen=True)
class PairSpec:
    """The request every pair sends, with the prefill's bootstrap address."""

    host: str
    prefill_port: int
    decode_port: int
    bootstrap_port: int
    prompt: str
    max_new_tokens: int

    def template(self) -> bytes:
        """The raw request with `%d` where the room goes (one format per pair)."""
        body = orjson.dumps({
            "text": self.prompt, "sampling_params": {"max_new_tokens": self.max_new_tokens},
            "bootstrap_host": self.host, "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": 1234567,
        }).replace(b"%", b"%%").replace(b"1234567", b"%d")
        head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n")
        return head + body


def rooms() -> Iterator[int]:
    """Fresh rooms: a random base, so runs against long-lived sims never reuse one."""
    return itertools.count(random.getrandbits(48) << 8)


def check_pair(prefill: bytes, decode: bytes, max_new_tokens: int) -> str | None:
    """Full check of one pair's answers; the reason if they are not a PD success."""
    p, d = orjson.loads(prefill), orjson.loads(decode)
    if p["meta_info"]["finish_reason"] != {"type": "length", "length": 0}:
        return f"prefill finish_reason {p['meta_info']['finish_reason']}"
    if d["meta_info"]["finish_reason"] != {"type": "length", "length": max_new_tokens}:
        return f"decode finish_reason {d['meta_info']['finish_reason']}"
    if d["output_ids"][0] != p["output_ids"][0]:
        return "decode did not continue from the prefill's first token"
    return None


async def worker(spec: PairSpec, results: Results, room_ids: Iterator[int],
                 check_every: int = 64) -> None:
    """Send PD pairs back to back until `results.stopping`."""
    prefill = await HttpConnection.open(spec.host, spec.prefill_port)
    decode = await HttpConnection.open(spec.host, spec.decode_port)
    template = spec.template()
    body_len = len(template.split(b"\r\n\r\n", 1)[1]) - 2  # without the "%d"
    clock = time.perf_counter
    try:
        for n in itertools.count():
            if results.stopping:
                return
            room = next(room_ids)
            raw = template % (body_len + len(str(room)), room)
            started = clock()
            p_answer = prefill.request(raw)
            d_answer = decode.request(raw)
            p_status, p_body = await p_answer
            d_status, d_body = await d_answer
            elapsed = clock() - started
            if p_status != 200 or d_status != 200:
                results.error(f"prefill {p_status} {p_body[:150]!r} / decode {d_status} {d_body[:150]!r}")
                continue
            if n % check_every == 0:
                why = check_pair(p_body, d_body, spec.max_new_tokens)
                results.checked += 1
                if why is not None:
                    results.error(why)
                    continue
            if results.recording:
                results.latencies.append(elapsed)
    finally:
        prefill.close()
        decode.close()
