"""The boundary of the data path: an upstream failure becomes the leg's UpstreamError.

Three data-path clients behind one small interface (`base.Upstream.post` ->
`base.UpstreamResponse`), chosen by `--upstream-client` from the name table of `choices.py`
(see docs/ARCHITECTURE.md, "Data-path client"):

* `FastUpstream` ("fast", default): the lean keep-alive client of `http11.py` (`fast.py`);
* `AiohttpUpstream` ("aiohttp", optional extra): aiohttp's client (`aiohttp_client.py`);
* `HttpxUpstream` ("httpx"): httpx, also used in unit tests (`httpx_client.py`).

Each raises the errors of `errors.py`, translated from its library's own; here they (and the
OS's) become an UpstreamError naming the leg and server, with the status the client gets and
whether another pair may succeed. All three verify https servers against `--upstream-ca-file`
(default: the system store) unless `--upstream-insecure`, and keep at most
`--upstream-max-connections` per server.
"""

from __future__ import annotations

import orjson

from gateway.errors import UpstreamError
from gateway.servers.pool import Server
from gateway.upstream.base import Upstream, UpstreamResponse, ssl_context
from gateway.upstream.errors import ConnectFailed, PoolTimeout, TransportError, UpstreamTimeout

__all__ = ["Upstream", "UpstreamResponse",
           "leg_error", "ssl_context", "status_error", "translated", "upstream_message"]

RETRYABLE_STATUSES = frozenset({408, 429})
REFUSED = "refused"  # UpstreamError.reason: nothing listens there (nothing was sent)


def leg_error(leg: str, url: str, exc: BaseException) -> BaseException:
    """What a leg raises for `exc`, in an `except` clause around its upstream calls (a context
    manager per leg cost three calls and an object per leg): the UpstreamError it stands
    for, caused by it, or `exc` itself."""
    error = translated(leg, url, exc) if isinstance(exc, Exception) else None
    if error is None:
        return exc
    error.__cause__ = exc  # as `raise error from exc`
    return error


def translated(leg: str, url: str, exc: Exception) -> UpstreamError | None:
    """The UpstreamError for a client or transport error (None: let it pass as it is)."""
    if isinstance(exc, PoolTimeout):
        return UpstreamError(f"{leg} server {url} is busy: {exc}", leg=leg, server_url=url,
                             retryable=True, status=503)
    if isinstance(exc, UpstreamTimeout):
        return UpstreamError(f"{leg} server {url} timed out ({exc.cause})",
                             leg=leg, server_url=url, retryable=True, status=504)
    if isinstance(exc, TimeoutError):
        return None  # the caller's own deadline: it knows which timeout and answers 504
    if isinstance(exc, ConnectFailed):
        return UpstreamError(f"{leg} server {url} refused or dropped the connection: {exc}",
                             leg=leg, server_url=url, retryable=True,
                             reason=REFUSED if exc.cause == "ConnectionRefusedError" else None)
    if isinstance(exc, TransportError | OSError):
        cause = exc.cause if isinstance(exc, TransportError) else type(exc).__name__
        return UpstreamError(f"{leg} server {url} failed: {cause}: {exc}",
                             leg=leg, server_url=url, retryable=True)
    return None


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


def status_error(leg: str, server: Server, status: int, body: bytes) -> UpstreamError:
    """An error for an HTTP status >= 400 from a leg.

    4xx (but 408/429) means the request itself was refused: pass the status through and do
    not retry. 408, 429 and 5xx are the server's trouble: retryable, 502 if they persist.
    """
    message = f"{leg} server {server.url} answered {status}: {upstream_message(body)}"
    if 400 <= status < 500 and status not in RETRYABLE_STATUSES:
        return UpstreamError(message, leg=leg, server_url=server.url, retryable=False,
                             upstream_status=status, status=status)
    return UpstreamError(message, leg=leg, server_url=server.url, retryable=True,
                         upstream_status=status, status=502)
