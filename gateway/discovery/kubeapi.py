"""A small client for the Kubernetes pods API: LIST and WATCH over httpx, nothing more.

Mechanics only: URLs, the bearer token, TLS, status codes and the watch stream's JSON lines.
What to do with pods and when to retry belongs to the caller (`watch.py`).

    ApiError     the API answered an error, or could not be reached (status None), or its
                 answer was not what the API sends (not JSON, not an object, a line too long)
     +-- Gone    410: the resourceVersion (or a list's continue token) is too old; LIST again

Every request ends: httpx's timeouts bound each read only, and a server that sends a byte
now and then resets them, so a LIST page has a total deadline and a watch stream is given
up once it outlives its own timeoutSeconds by READ_SLACK.

The client has its own `httpx.AsyncClient`: it trusts the cluster's CA rather than the
system's, and its long-lived watch streams must not sit in the data path's pool. The token
file is read before every request, so a rotated service-account token is picked up.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import httpx

LIST_PAGE = 500
# The API server gives a LIST up to its own 60 s (--request-timeout); on a loaded cluster
# (APF queueing, a slow etcd read) a page can take 35 s. A shorter read timeout gave up on
# such a LIST every time and retried it forever, so a read may take as long as the server.
LIST_READ_TIMEOUT = 60.0
# The whole page (headers and body), a little above the read timeout: a server trickling
# the body a byte at a time resets every read timeout, and must not hold the LIST forever.
LIST_DEADLINE = 90.0
READ_SLACK = 30.0  # seconds a watch may outlive its timeoutSeconds, silent or trickling
# One watch line is one object, and etcd's default request limit keeps an object under
# ~1.5 MiB: 16 MiB is far above any real event, and stops a stream without a newline from
# growing the buffer without end.
MAX_LINE = 16 << 20


class ApiError(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Gone(ApiError):
    """The resourceVersion is not in the API server's history: expired (410), or ahead of it
    (504 "Too large resource version": an API server restored from a backup, or one lagging
    behind the one that served the LIST); either way, LIST again (client-go does)."""


def _causes(obj: dict) -> list:
    """`details.causes` of a Status, or none: a malformed one must not hide the error."""
    details = obj.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    return causes if isinstance(causes, list) else []


def _error_from_status(obj: object, fallback: int | None, verb: str) -> ApiError:
    """A `Status` object (watch ERROR event or error body) -> the matching exception."""
    obj = obj if isinstance(obj, dict) else {}
    code = obj.get("code")
    code = code if isinstance(code, int) else fallback
    message = obj.get("message")
    text = f"{verb} pods: {code} {obj.get('reason') or ''} {message or ''}".strip()
    ahead = "Too large resource version" in str(message) or any(
        isinstance(c, dict) and c.get("reason") == "ResourceVersionTooLarge"
        for c in _causes(obj))
    return (Gone if code == 410 or ahead else ApiError)(text, code)


def _raise_for(response: httpx.Response, verb: str) -> None:
    if response.status_code == 200:
        return
    try:
        body = response.json()
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep to read
        body = {"message": response.text[:200]}
    raise _error_from_status(body, response.status_code, verb)


def _page(body: object) -> tuple[list[dict], dict]:
    """A LIST page's pods and metadata; ApiError when it is not shaped as a PodList (the
    caller would fail on it with an AttributeError that nothing expects)."""
    if not isinstance(body, dict):
        raise ApiError("LIST pods: the answer is not a JSON object")
    meta = body.get("metadata") or {}
    items = body.get("items") or []
    if not isinstance(meta, dict) or not isinstance(items, list):
        raise ApiError("LIST pods: the answer's metadata or items are malformed")
    return [i for i in items if isinstance(i, dict)], meta


def _event(line: bytes) -> dict | None:
    """One watch line -> its event (None for a blank line); an ERROR event is raised."""
    if not line.strip():
        return None
    try:
        event = json.loads(line.decode("utf-8"))  # UnicodeDecodeError is a ValueError
    except (ValueError, RecursionError):
        raise ApiError("WATCH pods: a line that is not JSON") from None
    if not isinstance(event, dict):
        raise ApiError("WATCH pods: an event that is not an object")
    if event.get("type") == "ERROR":
        raise _error_from_status(event.get("object"), None, "WATCH")
    if not isinstance(event.get("object"), dict):  # the caller reads it as a pod
        raise ApiError("WATCH pods: an event whose object is not an object")
    return event


class _Lines:
    """A byte stream cut into lines at b"\\n" only, each at most `limit` bytes.

    Not httpx's aiter_lines: it splits like str.splitlines(), also at U+0085, U+2028,
    \\x1c..., which JSON may carry raw inside a string (Go's encoding/json writes U+0085
    unescaped): one pod annotation made "a line that is not JSON" on every retry. Bytes are
    decoded per line, so a character split across chunks is whole again.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines `chunk` completes; the rest waits for the next chunk."""
        lines = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._add(chunk[start:end])
            lines.append(bytes(self._buffer))
            self._buffer.clear()
            start = end + 1
        self._add(chunk[start:])
        return lines

    def rest(self) -> bytes:
        """What followed the last newline (a stream may end without one)."""
        return bytes(self._buffer)

    def _add(self, data: bytes) -> None:
        # Checked before appending, so the buffer never holds more than the limit.
        if len(self._buffer) + len(data) > self.limit:
            self._buffer = bytearray()  # dropped now, not when the generator is collected
            raise ApiError(f"WATCH pods: a line over {self.limit} bytes")
        self._buffer += data


class KubeAPI:
    def __init__(self, server: str, *, token_file: str | None = None,
                 ca_file: str | None = None, connect_timeout: float = 5.0,
                 request_timeout: float = LIST_READ_TIMEOUT,
                 list_deadline: float = LIST_DEADLINE, max_line: int = MAX_LINE,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.server = server.rstrip("/")
        self.token_file = token_file
        self.connect_timeout = connect_timeout
        self.list_deadline = list_deadline
        self.max_line = max_line
        verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=ca_file) if ca_file else True)
        self._client = httpx.AsyncClient(
            verify=verify, transport=transport,
            timeout=httpx.Timeout(request_timeout, connect=connect_timeout),
            headers={"accept": "application/json"})

    async def aclose(self) -> None:
        await self._client.aclose()

    def _headers(self) -> dict[str, str]:
        if not self.token_file:
            return {}
        try:
            # ASCII: a bearer token is, and httpx cannot send anything else in a header
            # (UnicodeEncodeError); a file that is not text is an ApiError, logged and retried.
            token = Path(self.token_file).read_bytes().decode("ascii").strip()
        except (OSError, ValueError) as exc:
            raise ApiError(f"cannot read the API token {self.token_file}: {exc}") from exc
        return {"authorization": f"Bearer {token}"} if token else {}

    def _pods_url(self, namespace: str) -> str:
        return f"{self.server}/api/v1/namespaces/{quote(namespace, safe='')}/pods"

    async def list_pods(self, namespace: str, selector: str) -> tuple[list[dict], str]:
        """Every pod matching the selector, and the list's resourceVersion (paged)."""
        items: list[dict] = []
        token = None
        while True:
            page, meta = _page(await self._list_page(namespace, selector, token))
            items.extend(page)
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    async def _list_page(self, namespace: str, selector: str, token: str | None) -> object:
        """One page's JSON body, within `list_deadline` seconds from asking to the last byte."""
        params = {"labelSelector": selector, "limit": str(LIST_PAGE)}
        if token:
            params["continue"] = token
        try:
            # A plain await (the body is read whole inside get()), so a timeout is safe here.
            async with asyncio.timeout(self.list_deadline):
                response = await self._client.get(self._pods_url(namespace), params=params,
                                                  headers=self._headers())
        except TimeoutError:
            raise ApiError(f"LIST pods: no whole answer within {self.list_deadline:g}s") \
                from None
        except httpx.HTTPError as exc:
            raise ApiError(f"LIST pods: {type(exc).__name__}: {exc}") from exc
        _raise_for(response, "LIST")
        try:
            return response.json()
        except (ValueError, RecursionError):
            raise ApiError("LIST pods: the answer is not JSON") from None

    async def watch_pods(self, namespace: str, selector: str, resource_version: str,
                         timeout_seconds: int) -> AsyncIterator[dict]:
        """Events after `resource_version` until the server ends the stream, or until it
        outlived `timeout_seconds` by READ_SLACK (ApiError: the caller watches again).

        Yields `{"type": ADDED|MODIFIED|DELETED|BOOKMARK, "object": {...}}`; an ERROR event
        is raised (410 as `Gone`). Close it with `contextlib.aclosing`.
        """
        params = {"labelSelector": selector, "watch": "1", "resourceVersion": resource_version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        limit = timeout_seconds + READ_SLACK
        # The read timeout ends a silent stream; the deadline, checked on every chunk, one
        # that trickles. Not asyncio.timeout around the loop: it would also cover the yields,
        # and cancel the consumer's task wherever it stands while it handles an event.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        timeout = httpx.Timeout(limit, connect=self.connect_timeout)
        try:
            async with self._client.stream("GET", self._pods_url(namespace), params=params,
                                           headers=self._headers(),
                                           timeout=timeout) as response:
                if response.status_code != 200:
                    await response.aread()
                    _raise_for(response, "WATCH")
                lines = _Lines(self.max_line)
                async for chunk in response.aiter_bytes():
                    if loop.time() > deadline:
                        raise ApiError(f"WATCH pods: the stream outlived {limit:g}s")
                    for line in lines.feed(chunk):
                        if (event := _event(line)) is not None:
                            yield event
                if (event := _event(lines.rest())) is not None:
                    yield event
        except httpx.HTTPError as exc:
            raise ApiError(f"WATCH pods: {type(exc).__name__}: {exc}") from exc
