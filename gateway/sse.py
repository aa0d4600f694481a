"""Server-sent events: just enough to split a byte stream into events and frame new ones."""

from __future__ import annotations

from collections.abc import Iterator

import orjson

DONE = b"data: [DONE]\n\n"


class EventSplitter:
    """Accumulate raw chunks and yield complete events (bytes without the blank line)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._buffer + chunk
        if b"\r\n" in data:
            data = data.replace(b"\r\n", b"\n")
        *events, self._buffer = data.split(b"\n\n")
        return [e for e in events if e.strip()]

    def rest(self) -> bytes:
        return self._buffer


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's `data:` line(s), or None for comments and other fields."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(lines)


def frame(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


NOT_JSON = object()  # `parsed`: the event's data is [DONE] or not JSON


def parsed(splitter: EventSplitter, chunk: bytes) -> Iterator[tuple[bytes, bytes | None, object]]:
    """The complete events `chunk` ends, each as (event, its data or None when it has no
    data line, that data's JSON value or NOT_JSON): what every reader of events transforms."""
    for event in splitter.feed(chunk):
        payload = event_data(event)
        if payload is None or payload == b"[DONE]":
            yield event, payload, NOT_JSON
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            obj = NOT_JSON
        yield event, payload, obj


def data_objects(body: bytes) -> list[dict]:
    """All JSON objects carried by an SSE body (ignores [DONE] and non-JSON events)."""
    return [obj for _, _, obj in parsed(EventSplitter(), body + b"\n\n")
            if isinstance(obj, dict)]


def leading_failure(chunk: bytes) -> tuple[int, str] | None:
    """(status, message) when a stream's FIRST event reports a failure instead of tokens.

    SGLang answers a failed stream with HTTP 200 and then an error event: `{"error": {...}}`
    (OpenAI routes, and native validation errors) or a native chunk whose finish_reason is
    `abort` with a `status_code` (e.g. a PD transfer that failed). Spotting it before anything
    reached the client lets the gateway retry on another pair. A graceful abort (no status
    code) is not a failure.
    """
    if b'"error"' not in chunk and b'"abort"' not in chunk:
        return None
    event = chunk.split(b"\n\n", 1)[0]
    payload = event_data(event)
    if payload is None:
        return None
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    error = obj.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 400
        return status, str(error.get("message", "stream failed"))
    meta = obj.get("meta_info")
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(reason, dict) and reason.get("type") == "abort":
        status = reason.get("status_code")
        if isinstance(status, int) and 400 <= status < 600:
            return status, str(reason.get("message", "generation aborted"))
    return None
