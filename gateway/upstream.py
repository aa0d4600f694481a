"""The one pooled HTTP client and the translation of its errors at the boundary."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import orjson

from gateway.errors import UpstreamError
from gateway.workers import Worker

MAX_ERROR_BODY = 64 * 1024
RETRYABLE_STATUSES = frozenset({408, 429})


def build_client(
    connect_timeout: float,
    max_connections: int,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """One client per process. Reads are bounded by the dispatcher's own deadlines
    (first byte, idle gap, total), so httpx's read timeout stays off."""
    timeout = httpx.Timeout(connect=connect_timeout, read=None, write=connect_timeout,
                            pool=connect_timeout)
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections, keepalive_expiry=30)
    return httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport,
                             follow_redirects=False, trust_env=False)


@contextlib.contextmanager
def translate_errors(leg: str, worker: Worker) -> Iterator[None]:
    """Turn httpx and timeout errors into an UpstreamError naming the leg and server."""
    try:
        yield
    except httpx.ConnectError as exc:
        raise UpstreamError(f"{leg} server {worker.url} refused or dropped the connection: {exc}",
                            leg=leg, worker_url=worker.url, retryable=True) from exc
    except httpx.TimeoutException as exc:
        raise UpstreamError(f"{leg} server {worker.url} timed out ({type(exc).__name__})",
                            leg=leg, worker_url=worker.url, retryable=True, status=504) from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(f"{leg} server {worker.url} failed: {type(exc).__name__}: {exc}",
                            leg=leg, worker_url=worker.url, retryable=True) from exc


def upstream_message(body: bytes) -> str:
    """The human part of an error answer from SGLang (OpenAI error, FastAPI detail, or text)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return str(data)[:500]


def status_error(leg: str, worker: Worker, status: int, body: bytes) -> UpstreamError:
    """An error for an HTTP status >= 400 from a leg.

    4xx (but 408/429) means the request itself was refused: pass the status through and do
    not retry. 408, 429 and 5xx are the server's trouble: retryable, 502 if they persist.
    """
    message = f"{leg} server {worker.url} answered {status}: {upstream_message(body)}"
    if 400 <= status < 500 and status not in RETRYABLE_STATUSES:
        return UpstreamError(message, leg=leg, worker_url=worker.url, retryable=False,
                             upstream_status=status, status=status)
    return UpstreamError(message, leg=leg, worker_url=worker.url, retryable=True,
                         upstream_status=status, status=502)
