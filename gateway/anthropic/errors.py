"""Anthropic's error envelope for what the gateway refuses or fails on `/v1/messages*`.

`{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}`: the shape
SGLang 0.5.23 gives this path (`_anthropic_error_response` in http_server.py), so the Anthropic
SDK raises its typed exception (`BadRequestError`, `AuthenticationError`, `RateLimitError`,
...). The HTTP status stays the gateway's (the SDK picks its class by status); the type is
Anthropic's name for it, as SGLang maps it (`ERROR_TYPE_MAP` in entrypoints/anthropic/
serving.py, and its HTTPException handler for 413). A stream that already began ends with an
`error` event in the same shape (Anthropic's own stream error; the SDK raises it).
"""

from __future__ import annotations

import orjson

from gateway.errors import GatewayError

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
         500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "api_error"}
STATUSES = {"invalid_request_error": 400, "authentication_error": 401,
            "permission_error": 403, "not_found_error": 404, "request_too_large": 413,
            "rate_limit_error": 429, "api_error": 500, "overloaded_error": 503}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (any other 4xx is the request's fault)."""
    known = TYPES.get(status)
    if known is not None:
        return known
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def envelope(err: GatewayError, request_id: str | None = None) -> dict:
    body: dict = {"type": "error", "error": {"type": error_type(err.status),
                                             "message": err.message}}
    if request_id:
        body["request_id"] = request_id
    return body


def error_bytes(err: GatewayError, request_id: str | None = None) -> bytes:
    return orjson.dumps(envelope(err, request_id))


def error_event(err: GatewayError) -> bytes:
    """The event that ends a begun stream with `err`."""
    return b"event: error\ndata: " + orjson.dumps(envelope(err)) + b"\n\n"
