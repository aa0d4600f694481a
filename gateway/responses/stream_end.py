"""The end of a Responses stream that did not finish: typed as SGLang types it, and what the
turn's record says.

A decode that fails after the stream began cannot answer any more, so the relay ends the
stream with the gateway's own error event (`data: {"error": {...}}`, no `[DONE]`:
gateway/dispatch/stream_failure.py `error_ending`). A Responses client reads typed events only
(the OpenAI SDK drops an event without a `type`), so that event is made here what SGLang's
serving_responses.py sends when its generator fails: `event: response.failed`, its data
`{"type": "response.failed", "sequence_number": N, "response": {..., "status": "failed",
"error": {"code": "server_error", "message": ...}}}`, N the one after the last event relayed,
the response the one the stream opened with (`response.created`), and no `[DONE]`. That
response is the turn's record too, so GET says why the turn failed (until 2026-12-07: "the
request ended without a response (HTTP 200)", the stream's head, the cause lost).

A stream the client cut (it disconnected, or stopped reading) is no server failure: its
record says `cancelled`, as a cancel's does, with `incomplete_details.reason`
"client_disconnected" (docs/RESPONSES.md, "A stream the client cut").
"""

from __future__ import annotations

from gateway.responses.service import Turn

FAILED = "response.failed"
CUT = "client_disconnected"


class StreamEnd:
    """What a Responses stream relayed so far that its failed end needs: the last
    `sequence_number` and the response its lifecycle events carry."""

    __slots__ = ("sequence", "response")

    def __init__(self, turn: Turn) -> None:
        self.sequence = -1
        self.response: dict = {"id": turn.rid, "object": "response"}

    def seen(self, obj: dict) -> None:
        """Note a relayed typed event (each of the stream's events, already parsed)."""
        number = obj.get("sequence_number")
        if isinstance(number, int):
            self.sequence = number
        response = obj.get("response")
        if isinstance(response, dict):
            self.response = response

    def failed(self, message: str, rid: str) -> dict:
        """The `response.failed` event that ends the stream (its response the record)."""
        self.sequence += 1
        response = {**self.response, "id": rid, "status": "failed", "output": [],
                    "error": {"code": "server_error", "message": message}}
        return {"type": FAILED, "sequence_number": self.sequence, "response": response}


def gateway_error(obj: object) -> str | None:
    """The client's message of the gateway's own error event (untyped `{"error": {...}}`,
    the relay's end of a failed stream); None for any other event."""
    if not isinstance(obj, dict) or "type" in obj:
        return None
    error = obj.get("error")
    if not isinstance(error, dict):
        return None
    return str(error.get("message") or "the decode server failed mid-stream")


def failed(turn: Turn, status: int) -> dict:
    """The response of a turn that ended without one, before its stream began (what GET
    shows of it): the answer's HTTP status."""
    return {"id": turn.rid, "object": "response", "status": "failed", "output": [],
            "error": {"code": "server_error",
                      "message": f"the request ended without a response (HTTP {status})"}}


def cut(turn: Turn) -> dict:
    """The response of a turn whose stream the client cut: cancelled by the client, not
    failed by a server."""
    return {"id": turn.rid, "object": "response", "status": "cancelled", "output": [],
            "error": None, "incomplete_details": {"reason": CUT}}
