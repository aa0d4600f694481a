"""A small client for the Kubernetes pods API: LIST and WATCH over httpx, nothing more.

Mechanics only: URLs, the bearer token, TLS, status codes and the watch stream's JSON lines.
What to do with pods and when to retry belongs to the caller (`watch.py`).

    ApiError     the API answered an error, or could not be reached (status None)
     +-- Gone    410: the resourceVersion (or a list's continue token) is too old; LIST again

The client has its own `httpx.AsyncClient`: it trusts the cluster's CA rather than the
system's, and its long-lived watch streams must not sit in the data path's pool. The token
file is read before every request, so a rotated service-account token is picked up.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import httpx

LIST_PAGE = 500
READ_SLACK = 30.0  # seconds a watch may stay silent beyond its timeoutSeconds


class ApiError(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Gone(ApiError):
    """The resourceVersion is not in the API server's history: expired (410), or ahead of it
    (504 "Too large resource version": an API server restored from a backup, or one lagging
    behind the one that served the LIST); either way, LIST again (client-go does)."""


def _error_from_status(obj: dict, fallback: int | None, verb: str) -> ApiError:
    """A `Status` object (watch ERROR event or error body) -> the matching exception."""
    code = obj.get("code") if isinstance(obj, dict) else None
    code = code if isinstance(code, int) else fallback
    message = obj.get("message") if isinstance(obj, dict) else None
    reason = obj.get("reason") if isinstance(obj, dict) else None
    text = f"{verb} pods: {code} {reason or ''} {message or ''}".strip()
    causes = (obj.get("details") or {}).get("causes") if isinstance(obj, dict) else None
    ahead = "Too large resource version" in str(message) or any(
        isinstance(c, dict) and c.get("reason") == "ResourceVersionTooLarge" for c in causes or ())
    return (Gone if code == 410 or ahead else ApiError)(text, code)


def _raise_for(response: httpx.Response, verb: str) -> None:
    if response.status_code == 200:
        return
    try:
        body = response.json()
    except ValueError:
        body = {"message": response.text[:200]}
    raise _error_from_status(body, response.status_code, verb)


class KubeAPI:
    def __init__(self, server: str, *, token_file: str | None = None,
                 ca_file: str | None = None, connect_timeout: float = 5.0,
                 request_timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.server = server.rstrip("/")
        self.token_file = token_file
        self.connect_timeout = connect_timeout
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
            token = Path(self.token_file).read_text().strip()
        except OSError as exc:
            raise ApiError(f"cannot read the API token {self.token_file}: {exc}") from exc
        return {"authorization": f"Bearer {token}"} if token else {}

    def _pods_url(self, namespace: str) -> str:
        return f"{self.server}/api/v1/namespaces/{quote(namespace, safe='')}/pods"

    async def list_pods(self, namespace: str, selector: str) -> tuple[list[dict], str]:
        """Every pod matching the selector, and the list's resourceVersion (paged)."""
        items: list[dict] = []
        token = None
        while True:
            params = {"labelSelector": selector, "limit": str(LIST_PAGE)}
            if token:
                params["continue"] = token
            try:
                response = await self._client.get(self._pods_url(namespace), params=params,
                                                  headers=self._headers())
            except httpx.HTTPError as exc:
                raise ApiError(f"LIST pods: {type(exc).__name__}: {exc}") from exc
            _raise_for(response, "LIST")
            try:
                body = response.json()
            except ValueError:
                raise ApiError("LIST pods: the answer is not JSON") from None
            items.extend(i for i in body.get("items") or [] if isinstance(i, dict))
            meta = body.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    async def watch_pods(self, namespace: str, selector: str, resource_version: str,
                         timeout_seconds: int) -> AsyncIterator[dict]:
        """Events after `resource_version` until the server ends the stream.

        Yields `{"type": ADDED|MODIFIED|DELETED|BOOKMARK, "object": {...}}`; an ERROR event
        is raised (410 as `Gone`). Close it with `contextlib.aclosing`.
        """
        params = {"labelSelector": selector, "watch": "1", "resourceVersion": resource_version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        timeout = httpx.Timeout(timeout_seconds + READ_SLACK, connect=self.connect_timeout)
        try:
            async with self._client.stream("GET", self._pods_url(namespace), params=params,
                                           headers=self._headers(),
                                           timeout=timeout) as response:
                if response.status_code != 200:
                    await response.aread()
                    _raise_for(response, "WATCH")
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    try:
                        event = json.loads(line)
                    except ValueError:
                        raise ApiError("WATCH pods: a line that is not JSON") from None
                    if not isinstance(event, dict):
                        raise ApiError("WATCH pods: an event that is not an object")
                    if event.get("type") == "ERROR":
                        raise _error_from_status(event.get("object") or {}, None, "WATCH")
                    yield event
        except httpx.HTTPError as exc:
            raise ApiError(f"WATCH pods: {type(exc).__name__}: {exc}") from exc
