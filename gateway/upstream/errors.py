"""The errors every data-path client raises, whatever library it is built on.

Each adapter translates its library's errors into these where they arise (as httpx's
`map_httpcore_exceptions` does), so the boundary (`client.translated`) knows one vocabulary
and no library; the own client (`http11.py`) raises them directly.

    TransportError          the exchange failed: 502, another pair may succeed
     +-- ConnectFailed      refused, unreachable, TLS refused, connect timed out: 502
     +-- PoolTimeout        every allowed connection stayed busy for the whole wait: 503
     +-- UpstreamTimeout    the library's own read or write timeout: 504
     +-- ConnectionLost     closed or reset before the response was complete
     +-- ProtocolViolation  an answer that is not HTTP/1.1

A plain `TimeoutError` is none of these: it is the caller's own deadline.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of data-path client errors (an UpstreamError at the boundary).

    `cause` names the library's own error class, which the message to the client keeps."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause or type(self).__name__


class ConnectFailed(TransportError):
    """No connection to the server: nothing was sent."""


class PoolTimeout(TransportError):
    """Every allowed connection to the server stayed busy for the whole wait."""


class UpstreamTimeout(TransportError):
    """A timeout of the client library itself (not the gateway's deadlines)."""


class ConnectionLost(TransportError):
    """The server closed or reset the connection before the response was complete."""

    def __init__(self, message: str, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class ProtocolViolation(TransportError):
    """The server's answer broke HTTP/1.1 (or the URL is not an http(s) server)."""


ErrorTable = tuple[tuple[type[BaseException], type[TransportError]], ...]


def mapped(exc: BaseException, table: ErrorTable) -> TransportError:
    """The error of the first `table` row whose library class `exc` is (rows run from the
    most specific class to the most general), else a plain TransportError."""
    for library_error, ours in table:
        if isinstance(exc, library_error):
            return ours(str(exc), cause=type(exc).__name__)
    return TransportError(str(exc), cause=type(exc).__name__)
