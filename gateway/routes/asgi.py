"""Small ASGI helpers shared by the handlers: the one body reader and JSON answers."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.types import Receive, Send

from gateway.admission.body_budget import BodyLease
from gateway.errors import BadRequest, GatewayError, PayloadTooLarge, error_bytes

SMALL_BODY = 64 * 1024  # admin and operations bodies are a few fields


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_body(scope: dict, receive: Receive, limit: int, buffer: bool = False,
                    lease: BodyLease | None = None) -> bytes | bytearray:
    """The whole request body, refusing more than `limit` bytes without reading them all.
    `buffer`: a body with a Content-Length is read into one bytearray grown as its chunks
    arrive, so a large body is held once, not as chunks and then their join (twice); never
    allocated at its declared size up front: a head declaring 32 MiB and no body then held
    32 MiB (40 such heads took one process from 72 to 1,331 MiB, past the budget, which
    charges bytes received). `lease`: the in-flight body budget's share of this request,
    charged chunk by chunk (a declared length that does not fit is refused before anything
    is read). One loop for
    every way, straight on the server's `receive`: no coroutine frame of its own per chunk."""
    declared = 0
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = 0
            if declared > limit:
                raise PayloadTooLarge(f"request body of {declared} bytes exceeds the "
                                      f"limit of {limit} bytes")
            break
    if lease is not None and declared > 0:
        lease.declared(declared)
    data = bytearray() if buffer and declared > 0 else None
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            if lease is not None:
                lease.take(len(chunk))
            end = size + len(chunk)
            if end > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            if data is None:
                chunks.append(chunk)
            else:
                data += chunk
            size = end
        if not message.get("more_body", False):
            if data is not None:
                return data
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_json(request: Request, limit: int = SMALL_BODY) -> dict:
    """A small JSON object body (admin and operation routes), read with the same reader."""
    return (await read_json_raw(request, limit))[1]


async def read_json_raw(request: Request, limit: int,
                        lease: BodyLease | None = None) -> tuple[bytes, dict]:
    """A JSON object body and its bytes (a relay forwards the bytes as sent)."""
    raw = await read_body(request.scope, request.receive, limit, lease=lease)
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return raw, body


def header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, err: GatewayError, request_id: str | None = None) -> None:
    extra = [(k.encode(), v.encode()) for k, v in err.headers.items()]
    if request_id:
        extra.append((b"x-request-id", request_id.encode()))
    await send_bytes(send, err.status, error_bytes(err, request_id), b"application/json", extra)
