"""A non-streamed decode answer, read whole: bounded once it began, and checked whole.

SGLang writes a whole answer at once (the `ORJSONResponse` of a finished request, in
`entrypoints/http_server.py` and the OpenAI serving classes), so once its head arrived the
body follows at wire speed: a body that stops halfway with the connection left open is a
stalled server, not a slow one. Each chunk must come within the decode's learned gap deadline
(gateway/health/deadlines.py), by moving the attempt's deadline.

A body that is not one whole JSON document (cut off by a server or a proxy that then closed,
or a close-delimited body cut short) is the decode's failure, and a retryable one: it is
never relayed as a success. It is parsed (orjson, about 1 GB/s: microseconds for an answer),
not scanned, since a cut may fall right after any closing brace. What was generated is
learned as the decode's speed: its time since the KV was there, per token.
"""

from __future__ import annotations

import orjson

from gateway.dispatch.attempt import Attempt, Timeouts
from gateway.errors import UpstreamError
from gateway.health.deadlines import LatencyModel
from gateway.observability.answer_tokens import completion_total
from gateway.upstream.client import UpstreamResponse


async def read_whole(attempt: Attempt, response: UpstreamResponse, model: LatencyModel,
                     timeouts: Timeouts, loop) -> bytes:
    """The decode's whole answer (its head was read), or the leg's UpstreamError."""
    url = attempt.decode.url
    deadline = attempt.deadline
    hard = min(attempt.started_at + timeouts.response, attempt.not_after)
    # learned once per answer: a body comes at wire speed, its chunks microseconds apart
    gap = model.gap_deadline(url, timeouts.stream_idle, attempt.urgency) \
        if deadline is not None else 0.0
    parts = []
    while True:
        if deadline is not None:
            deadline.move(min(loop.time() + gap, hard))
        chunk = await response.next_chunk()
        if chunk is None:
            break
        parts.append(chunk)
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        raise UpstreamError(
            f"decode server {url} answered 200 with a body that is not whole JSON "
            f"({len(body)} bytes, cut off?)", leg="decode", server_url=url, retryable=True,
            status=502) from None
    _learn(attempt, body, model, loop.time())
    return body


def _learn(attempt: Attempt, body: bytes, model: LatencyModel, now: float) -> None:
    """One answer of one item whose KV came first: its time per token, as a gap."""
    if attempt.kv_at and attempt.view.room_count is None:
        tokens = completion_total(body)
        if tokens:
            ring = model.gaps_of(attempt.decode.url)
            if ring.skip:
                ring.skip -= 1
            else:
                model.gap(ring, (now - attempt.kv_at) / tokens)
