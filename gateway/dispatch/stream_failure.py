"""A failure a decode reports inside a stream that has begun: found, so the relay treats it
as the decode's failure instead of passing the server's words through.

SGLang ends a stream it cannot finish with HTTP 200 already sent, so the failure comes as an
event: `{"error": {...}}` on the OpenAI routes (`OpenAIServingBase.create_streaming_error_response`,
written by `OpenAIServingChat._generate_chat_stream` for an abort that carries a status code)
and on `/generate` (`http_server.generate_request`, a late `ValueError`); on `/v1/messages`, an
`event: error`. Their messages are the server's own, addresses included ("Prefill server with
bootstrap_addr: 10.0.0.5:8998 is healthy before, but now it is down", `CommonKVReceiver`). A
failure in the stream's head is `sse.leading_failure`'s (retried before the client saw
anything; it also reads a native abort's `finish_reason`, which is where a KV transfer's
failure comes); this one is after it.

A substring search of every chunk cost 7.6% of a relayed event's instructions (2,278,142 to
2,451,106 a 65-event chat stream, `python -m loadtests.instruction_cost --endpoint chat-stream
--base <tree>`), and a helper that also looked for a second event in the chunk 13%. So the
relay compares one byte where a chunk's first event would say "error" (a slice: a chunk
may be shorter), and reads the chunk's events only when it is an "e". Not found: a failure
behind other events in one read (the relay reads each event as it comes, so it fell behind
then), and a native abort `finish_reason` after the head (`sse.leading_failure` reads it in
the head, where a KV transfer's failure comes); both pass through as the server wrote them.
"""

from __future__ import annotations

import orjson

from gateway.anthropic.errors import STATUSES, error_event
from gateway.errors import GatewayError
from gateway.request import MESSAGES, RESPONSES
from gateway.sse import DONE, event_data, frame, reported_failure, split_events

OPENING = b'data: {"error"'  # orjson's `{"error":` and json.dumps's `{"error": ` alike
MESSAGES_OPENING = b"event: error"


def marks(endpoint: str) -> tuple[bytes, int, int]:
    """The opening of a failure event in `endpoint`'s stream, and the slice of its "e"."""
    return (MESSAGES_OPENING, 7, 8) if endpoint == MESSAGES else (OPENING, 8, 9)


def error_ending(exc: GatewayError, endpoint: str) -> bytes:
    """The gateway's event that ends `endpoint`'s stream on `exc`: Anthropic's error event;
    on /v1/responses the error alone, no `[DONE]` (SGLang sends none there), which the
    turn's watch makes `response.failed` (gateway/responses/stream_end.py); elsewhere the
    OpenAI error event and `[DONE]`."""
    if endpoint == MESSAGES:
        return error_event(exc)
    return frame(exc.body()) + (b"" if endpoint == RESPONSES else DONE)


def failing_event(chunk: bytes, endpoint: str) -> tuple[bytes, int, str] | None:
    """(the events before it, its status, its message) for the first event of `chunk`
    (whole events) that reports a failure; None when none does. Only an event that opens as
    a failure, or names an abort, is parsed. A graceful abort (no status code: a client's or
    an admin's `/abort_request`) is no failure."""
    opening = marks(endpoint)[0]
    events = split_events(chunk)
    for at, event in enumerate(events):
        if not event.startswith(opening) and b'"abort"' not in event:
            continue
        failure = _failure(event, endpoint == MESSAGES)
        if failure is not None:
            return b"".join(e + b"\n\n" for e in events[:at]), *failure
    return None


def _failure(event: bytes, anthropic: bool) -> tuple[int, str] | None:
    payload = event_data(event)
    if payload is None or (anthropic and not event.startswith(MESSAGES_OPENING)):
        return None
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not anthropic:
        return reported_failure(obj)
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict):
        return None
    return STATUSES.get(error.get("type"), 500), str(error.get("message", "stream failed"))
