"""Every error as an OpenAI-style JSON answer, including unknown routes and methods; under
`/v1/messages` in Anthropic's envelope (gateway/anthropic/errors.py), as SGLang's handlers do."""

from __future__ import annotations

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.anthropic import errors as anthropic
from gateway.errors import GatewayError, NotFound, error_body, error_bytes

ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's envelope there, as SGLang answers on them


def json_error(err: GatewayError, path: str = "", operator: bool = False) -> Response:
    """`operator`: the route is an admin's, and the error says all it knows (addresses)."""
    body = (anthropic.error_bytes(err) if path.startswith(ANTHROPIC_PATHS)
            else error_bytes(err, operator=operator))
    return Response(body, status_code=err.status, media_type="application/json",
                    headers=err.headers)


async def gateway_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, GatewayError):
        return json_error(exc, request.url.path)
    return await http_error(request, exc)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404/405 and friends in the OpenAI error shape."""
    status = getattr(exc, "status_code", 500)
    if status == 404:
        return json_error(NotFound(f"no route {request.method} {request.url.path}"),
                          request.url.path)
    detail = getattr(exc, "detail", None) or "request failed"
    if request.url.path.startswith(ANTHROPIC_PATHS):
        headers = dict(getattr(exc, "headers", None) or {})
        return json_error(GatewayError(f"{request.method} {request.url.path}: {detail}",
                                       status=status, headers=headers), request.url.path)
    kind = "invalid_request_error" if status < 500 else "internal_error"
    headers = dict(getattr(exc, "headers", None) or {})
    return Response(orjson.dumps(error_body(f"{request.method} {request.url.path}: {detail}",
                                            kind, str(status))),
                    status_code=status, media_type="application/json", headers=headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug on a Starlette route: the usual JSON shape, nothing of the exception (Starlette's
    ServerErrorMiddleware logs it and re-raises after this answer), not a text/plain 500."""
    return json_error(GatewayError("internal error"), request.url.path)


HANDLERS = {GatewayError: gateway_error, HTTPException: http_error, Exception: internal_error}
