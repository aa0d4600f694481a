"""Server-sent events: just enough to split a byte stream into events and frame new ones."""

from __future__ import annotations

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


def data_objects(body: bytes) -> list[dict]:
    """All JSON objects carried by an SSE body (ignores [DONE] and non-JSON events)."""
    splitter = EventSplitter()
    objects = []
    for event in splitter.feed(body + b"\n\n"):
        payload = event_data(event)
        if payload is None or payload == b"[DONE]":
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            objects.append(obj)
    return objects
