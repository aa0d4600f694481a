"""Server-sent events: just enough to split a byte stream into events and frame new ones.

An event ends at a blank line, and SSE allows three line ends: "\r\n", "\n" and "\r". A
stream cut anywhere is split here, once, for every reader (the relay, the Responses watch,
the merges): `whole_events` finds the last boundary, `EventSplitter` holds the partial rest
between chunks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import orjson

DONE = b"data: [DONE]\n\n"


def whole_events(data: bytes) -> tuple[bytes, bytes]:
    """(the bytes of the events `data` completes, as they came; the partial rest). Two line
    ends in a row make a blank line, and any two in a row contain "\n\n", "\r\r" or "\n\r"
    (a run of "\r" and "\n" without them is one line end: "\n", "\r" or "\r\n"), so the
    last of those three ends the last event. The relay checks the common end, "\n\n", inline."""
    if data.endswith(b"\n\n"):
        return data, b""
    at = max(data.rfind(b"\n\n"), data.rfind(b"\r\r"), data.rfind(b"\n\r"))
    if at < 0:
        return b"", data
    cut = at + 2
    if data[at + 1:cut + 1] == b"\r\n":  # the blank line's own "\r\n"
        cut += 1
    return data[:cut], data[cut:]


def split_events(data: bytes) -> list[bytes]:
    """The events of `data` (whole events), their lines ended by "\n", without blank lines
    (a blank line's "\n" left by a cut inside its "\r\n" among them)."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return [e.lstrip(b"\n") for e in data.split(b"\n\n") if e.strip()]


class EventSplitter:
    """Accumulate raw chunks; hand out complete events (the partial rest held back)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def whole(self, chunk: bytes, ended: bool = False) -> bytes:
        """The bytes of the events `chunk` completes, as they came; all that is held when the
        stream `ended`."""
        data = self._buffer + chunk if self._buffer else chunk
        if ended:
            self._buffer = b""
            return data
        out, self._buffer = whole_events(data)
        return out

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events `chunk` completes, as `split_events` gives them."""
        return split_events(self.whole(chunk))

    def rest(self) -> bytes:
        return self._buffer


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's `data:` line(s), or None for comments and other fields."""
    lines = [line[5:].lstrip(b" ") for line in event.splitlines()
             if line.startswith(b"data:") or line == b"data"]
    if not lines:
        return None
    return b"\n".join(lines)


def with_data(event: bytes, obj: object) -> bytes:
    """`event` (as `split_events` gives it) framed again with `obj` as its data, in one line
    where its first data line was: its other fields (event, id) kept."""
    lines, data = [], b"data: " + orjson.dumps(obj)
    for line in event.split(b"\n"):
        if not (line.startswith(b"data:") or line == b"data"):
            lines.append(line)
        elif data:
            lines.append(data)
            data = b""
    return b"\n".join(lines) + b"\n\n"


def frame(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


NOT_JSON = object()  # `parsed`: the event's data is [DONE] or not JSON


def decoded(events: Iterable[bytes]) -> Iterator[tuple[bytes, bytes | None, object]]:
    """Each event as (event, its data or None when it has no data line, that data's JSON
    value or NOT_JSON): what every reader of events transforms."""
    for event in events:
        payload = event_data(event)
        if payload is None or payload == b"[DONE]":
            yield event, payload, NOT_JSON
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            obj = NOT_JSON
        yield event, payload, obj


def parsed(splitter: EventSplitter, chunk: bytes) -> Iterator[tuple[bytes, bytes | None, object]]:
    """The complete events `chunk` ends, `decoded`."""
    return decoded(splitter.feed(chunk))


def data_objects(body: bytes) -> list[dict]:
    """All JSON objects carried by an SSE body (ignores [DONE] and non-JSON events)."""
    return [obj for _, _, obj in decoded(split_events(body)) if isinstance(obj, dict)]


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
    events = split_events(chunk)
    payload = event_data(events[0]) if events else None
    if payload is None:
        return None
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return reported_failure(obj)


def reported_failure(obj: object) -> tuple[int, str] | None:
    """(status, message) when an event's JSON value reports a failure: an `error` object (its
    `code` the status, 400 without one), or a native `finish_reason` of `abort` with a status
    code."""
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


# streams that end with a typed last event, not [DONE]: SGLang's /v1/responses
# (`_responses_stream_generator_non_harmony`: response.completed, .incomplete or .failed)
FINAL_EVENTS = (b"event: response.completed\n", b"event: response.incomplete\n",
                b"event: response.failed\n",
                b"event: message_stop\n")  # /v1/messages (`_generate_anthropic_stream`)
FINAL_NAMES = frozenset(e[len(b"event: "):-1] for e in FINAL_EVENTS)


def ends_finished(last: bytes, prior: bytes = b"") -> bool:
    """Whether the last events relayed end with a stream's typed final event, or [DONE] in
    another framing than `DONE`'s. SGLang's framing is checked first; any other (a proxy's:
    other line ends, field order or spacing) is read field by field. Comments (": ping", a
    proxy's keep-alive) after the final event are no events: skipped, and when `last` holds
    nothing else, the chunk before it (`prior`) is read (until 2026-12-07 a complete stream
    with a comment after its end was ended with an error event)."""
    start = last.rfind(b"\n\n", 0, len(last) - 2) + 2  # (0 when `last` is one event)
    if last.startswith(FINAL_EVENTS, start if start > 1 else 0):
        return True
    events = [e for e in split_events(last) if not _comment(e)]
    if not events:
        return bool(prior) and (prior.endswith(DONE) or ends_finished(prior))
    final = events[-1]
    names = (line[6:].removeprefix(b" ") for line in final.split(b"\n")
             if line.startswith(b"event:"))
    return event_data(final) == b"[DONE]" or any(name in FINAL_NAMES for name in names)


def _comment(event: bytes) -> bool:
    """An event of comment lines only (no field): SSE readers ignore it."""
    return all(line.startswith(b":") for line in event.split(b"\n") if line)
