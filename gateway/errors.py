"""Typed gateway errors, each carrying its HTTP status and OpenAI error type.

Hierarchy (one place to map every failure to a client-visible answer):

    GatewayError
    ├── BadRequest            400 invalid_request_error
    │   └── PayloadTooLarge   413
    ├── Unauthorized          401 authentication_error
    ├── Forbidden             403 permission_error (a key without the role a route needs)
    ├── NotFound              404
    │   └── ModelNotFound     404 invalid_request_error, code model_not_found (OpenAI's)
    ├── TooManyRequests       429 rate_limit_error (admission full)
    ├── ServiceUnavailable    503 (no usable prefill/decode pair, draining, queue timeout)
    ├── GatewayTimeout        504 timeout_error (the client's own deadline passed first)
    └── UpstreamError         502 / 504 (a leg failed; says which leg and why)
"""

from __future__ import annotations

import re

import orjson

# A server's address in a failure's text: a URL (scheme, authority and whatever follows up to
# a space or punctuation, a data-parallel rank's `#dp1` included), taken out with the space
# before it; or a bare address, as SGLang's KV transfer writes its peers ("Failed to send kv
# chunk of 7 to 10.0.0.5:16000": `NetworkAddress.to_host_port_str`), an IPv4 address, a
# bracketed IPv6 one or a dotted host name with a port, replaced by `<address>`.
_ADDRESS = re.compile(r"(?P<url> ?\b[a-z][a-z0-9+.-]*://[^\s,;()\"']+)"
                      r"|\[[0-9A-Fa-f:.]+\](?::\d+)?"
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"
                      r"|\b[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+:\d{2,5}\b")


def _hidden(found: re.Match) -> str:
    return "" if found.group("url") else "<address>"


def without_addresses(text: str) -> str:
    """`text` with every URL taken out and every bare address replaced: a caller learns which
    leg failed and what its server said, never where the servers are (docs/SECURITY.md,
    "What an error tells")."""
    return _ADDRESS.sub(_hidden, text)


class GatewayError(Exception):
    """Base error: a message for the client plus HTTP status and OpenAI error type, and a
    `detail` for the operator (logs, traces, the status page), the same text unless the
    message had to leave something out."""

    status: int = 500
    error_type: str = "internal_error"
    servers_words = False  # the message relays a server's text whatever the status

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message if detail is None else detail)  # str(): the operator's
        if status is not None:
            self.status = status
            if self.error_type == "internal_error" and status != 500:  # a 409 is the
                self.error_type = ("invalid_request_error" if status < 500  # caller's doing
                                   else "timeout_error" if status == 504 else "internal_error")
        # A failure on the servers' side (5xx) tells the client no address; 4xx messages are
        # about the caller's own input (a media URL it sent, say) and keep theirs.
        self.message = (without_addresses(message) if self.status >= 500 or self.servers_words
                        else message)
        self.detail = message if detail is None else detail
        self.code = code
        self.headers = headers or {}

    def body(self, operator: bool = False) -> dict:
        """The OpenAI-style error object (`operator`: an admin's, with the `detail`)."""
        return error_body(self.detail if operator else self.message, self.error_type,
                          self.code or str(self.status))


class BadRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    status = 413


class Unauthorized(GatewayError):
    status = 401
    error_type = "authentication_error"


class Forbidden(GatewayError):
    status = 403
    error_type = "permission_error"


class NotFound(GatewayError):
    status = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    """A request for a model this gateway does not serve, in OpenAI's (and SGLang's) shape."""

    error_type = "invalid_request_error"

    def __init__(self, name: str, available: list[str], unnamed: int = 0) -> None:
        pending = (f"; {unnamed} servers have not reported their model yet" if unnamed
                   else "")
        super().__init__(f"The model '{name}' does not exist; served here: "
                         f"{', '.join(available) or 'none'}{pending}", code="model_not_found")

    def body(self, operator: bool = False) -> dict:
        return error_body(self.message, self.error_type, self.code or "404", "model")


class TooManyRequests(GatewayError):
    status = 429
    error_type = "rate_limit_error"


class ServiceUnavailable(GatewayError):
    status = 503
    error_type = "service_unavailable"


class GatewayTimeout(GatewayError):
    status = 504
    error_type = "timeout_error"


class UpstreamError(GatewayError):
    """A prefill or decode leg failed. The client's message names the leg and carries the
    server's own words without the server's address; `detail` keeps it for the operator.

    `retryable` tells the retry loop whether another pair may succeed (connect errors,
    5xx, 408/429); `upstream_status` keeps the server's own status for metrics.
    """

    status = 502
    error_type = "upstream_error"
    servers_words = True  # a 4xx relayed from a server is the server's text too

    def __init__(
        self,
        message: str,
        *,
        leg: str,
        server_url: str,
        retryable: bool,
        upstream_status: int | None = None,
        status: int | None = None,
        code: str | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code)
        self.reason = reason  # metric label: why it failed, when not an HTTP status
        self.leg = leg
        self.server_url = server_url
        self.retryable = retryable
        self.upstream_status = upstream_status
        if 400 <= self.status < 500:
            self.error_type = "invalid_request_error"
        elif self.status == 504:
            self.error_type = "timeout_error"


def error_body(message: str, error_type: str, code: str, param: str | None = None) -> dict:
    """OpenAI's error object. `code` is always a string (OpenAI's schema types it string or
    null, and typed clients decode it as one): a name such as `model_not_found` where the
    gateway has one, else the HTTP status as digits ("503"); `param` is always present."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_bytes(err: GatewayError, request_id: str | None = None, operator: bool = False
                ) -> bytes:
    body = err.body(operator)
    if request_id:
        body["error"]["request_id"] = request_id
    return orjson.dumps(body)
