"""The sims' KV channel: wire format, line reader, batching writer.

A decode sim keeps one persistent TCP connection to each prefill bootstrap
server it talks to. The connection starts as HTTP/1.1 on the bootstrap port
(`GET /route`, like SGLang's decode fetching the prefill's info), then
upgrades (`Upgrade: sim-kv/1` -> `101 Switching Protocols`) to a stream of
JSON arrays, one per line, in both directions:

    decode -> prefill   ["join", tag, room, rid]   take the decode half of `room`
                        ["abort", tag, reason]     the decode gave up on that join
    prefill -> decode   ["refused", tag, reason]   handshake failed (duplicate room, ...)
                        ["kv", tag, {...}]         the KV arrived: prompt_tokens, seed,
                                                   cached_tokens, first_token, first_logprob
                        ["failed", tag, reason]    the prefill side failed the room

`tag` numbers the joins of one connection, so a late answer to a request that
gave up can never reach a later request for the same room, and an abort only
ever fails a room its own join took. A join that is not refused is accepted
(there is no "joined" answer: it would cost a message per pair and tell the
decode nothing it needs; the stream is ordered, so an abort always arrives
after its join).

Why not HTTP requests per pair: that was 2-3 requests per PD pair through an
HTTP client and a second web app (plus a long-poll), which cost more CPU than
the rest of the pair and made the decode wait on its client's connection pool.
Here a pair costs two small lines, and the lines of one loop iteration leave
in one write.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

UPGRADE = b"sim-kv/1"
CHANNEL_PATH = "/sim/kv"
_MAX_HEAD = 65536
_NEWLINE = orjson.OPT_APPEND_NEWLINE


class LineReader:
    """Cuts a byte stream into JSON messages (one per line)."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> list[Any]:
        """The messages completed by `data`; raises ValueError on a bad line."""
        if self._partial:
            data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [orjson.loads(line) for line in lines if line]


class BatchWriter:
    """Queues messages and writes all of one loop iteration at once (one syscall)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._chunks: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def send(self, message: list[Any]) -> None:
        if not self._chunks:
            self._loop.call_soon(self._flush)
        self._chunks.append(orjson.dumps(message, option=_NEWLINE))

    def _flush(self) -> None:
        chunks, self._chunks = self._chunks, []
        if not self.transport.is_closing():
            self.transport.write(b"".join(chunks))


def take_response(buffer: bytearray) -> tuple[int, bytes] | None:
    """Cut one whole HTTP/1.1 response (status, body) off `buffer`; None if incomplete.

    Enough for the two answers of the channel set-up (Content-Length bodies
    only); anything else raises ValueError, which the decode treats as "not a
    prefill bootstrap server".
    """
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        if len(buffer) > _MAX_HEAD:
            raise ValueError("HTTP answer head too long")
        return None
    lines = bytes(buffer[:head_end]).decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP answer: {lines[0][:80]!r}")
    status = int(rest.split(" ", 1)[0])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise ValueError("chunked HTTP answers are not expected here")
    length = int(headers.get("content-length", "0"))
    end = head_end + 4 + length
    if len(buffer) < end:
        return None
    body = bytes(buffer[head_end + 4:end])
    del buffer[:end]
    return status, body
