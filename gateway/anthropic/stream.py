"""Reading the head of an Anthropic event stream for a failure before its first token.

SGLang's `_generate_anthropic_stream` sends `message_start` as soon as the first chat chunk
is out, and a failure before any token (a KV transfer that failed, a request refused by the
scheduler) comes after it: `_flush_on_error` sends message_start, the error event, then
message_stop. So the gateway reads on past the events that say nothing yet (message_start,
ping, a content block's start) to the first that does; an error there is the decode's
failure before the client saw anything, retried on another pair like a chat stream's leading
error event (`sse.leading_failure`). The wait is bounded by the attempt's first-progress
deadline, as the first event's is.
"""

from __future__ import annotations

import orjson

from gateway.anthropic.errors import STATUSES
from gateway.dispatch.relay import first_event
from gateway.request import MESSAGES, RequestView
from gateway.sse import event_data
from gateway.sse import leading_failure as openai_leading_failure
from gateway.upstream.base import UpstreamResponse

OPENING = (b"event: message_start", b"event: ping", b"event: content_block_start")
ERROR = b"event: error"


def _events(data: bytes) -> list[bytes]:
    """The whole events of `data` (a last one without its blank line is not yet whole)."""
    if b"\r\n" in data:
        data = data.replace(b"\r\n", b"\n")
    return [e.strip(b"\n") for e in data.split(b"\n\n")[:-1] if e.strip()]


def _only_opening(data: bytes) -> bool:
    return all(event.startswith(OPENING) for event in _events(data))


async def opening(response: UpstreamResponse, first: bytes) -> bytes:
    """`first` (the stream's first whole event) read on until an event that is not an
    opening one is whole, or the stream ends."""
    while first and _only_opening(first):
        more = await response.next_chunk()
        if more is None:
            break
        first += more
    return first


async def stream_head(response: UpstreamResponse, view: RequestView, url: str) -> bytes:
    """The decode stream's first whole event; for `/v1/messages`, read on past the opening
    events (a stream of another path as `relay.first_event` reads it)."""
    first = await first_event(response, url)
    return await opening(response, first) if view.endpoint == MESSAGES else first


def head_failure(first: bytes, view: RequestView) -> tuple[int, str] | None:
    """(status, message) when the stream's head reports a failure instead of tokens."""
    if view.endpoint == MESSAGES:
        return leading_failure(first)
    return openai_leading_failure(first)


def leading_failure(first: bytes) -> tuple[int, str] | None:
    """(status, message) when an error event comes before any content."""
    if ERROR not in first:
        return None
    for event in _events(first):
        if not event.startswith(ERROR):
            if not event.startswith(OPENING):
                return None
            continue
        try:
            body = orjson.loads(event_data(event) or b"")
        except orjson.JSONDecodeError:
            return 502, "the decode server's error event is not JSON"
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return 502, "the decode server sent an error event without an error"
        return STATUSES.get(error.get("type"), 500), str(error.get("message", "stream failed"))
    return None
