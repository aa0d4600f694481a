"""A fake Kubernetes pods API on 127.0.0.1: LIST and WATCH with resourceVersions.

Raw asyncio HTTP/1.1 (one request per connection, `Connection: close`), enough of the API
for discovery: `GET /api/v1/namespaces/{ns}/pods?labelSelector=...` lists the pods with the
current resourceVersion; with `watch=1&resourceVersion=N` it streams, as chunked JSON lines,
every retained event after N, then new ones, until `timeoutSeconds` or `close_watches()`.
A watch from a version older than the last `compact()` is answered 410 Gone, as an ERROR
event (what the API server does) or as an HTTP status (`gone_as="status"`).

Every method that changes state runs on the server's loop: call it directly from an async
test, or through `ThreadedFakeKube.call` from another thread.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

PODS_PREFIX = "/api/v1/namespaces/"
CLOSE = object()  # queue sentinel: end the watch stream cleanly
ABORT = object()  # queue sentinel: drop the connection mid-stream


def make_pod(name: str, *, role: str | None = None, ip: str | None = "10.0.0.1",
             ready: bool = True, phase: str = "Running", labels: dict | None = None,
             annotations: dict | None = None, ports: list[dict] | None = None,
             uid: str | None = None) -> dict:
    """A pod as the API returns it (only the fields discovery reads, plus a few)."""
    all_labels = {"app": "sglang", **({"role": role} if role else {}), **(labels or {})}
    status: dict = {"phase": phase, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "uid": uid or f"uid-{name}", "labels": all_labels,
                     "annotations": dict(annotations or {})},
        "spec": {"containers": [{"name": "sglang", "ports": ports or []}]},
        "status": status,
    }


def selector_matches(selector: str, labels: dict) -> bool:
    """Equality (`a=b`, `a==b`), inequality (`a!=b`), existence (`a`, `!a`) and `in`."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    for term in (t.strip() for t in terms if t.strip()):
        if "!=" in term:
            key, value = (p.strip() for p in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (p.strip() for p in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif " in " in term:
            key, values = term.split(" in ", 1)
            allowed = {v.strip() for v in values.strip().strip("()").split(",")}
            if labels.get(key.strip()) not in allowed:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class Seen:
    """One request the fake answered."""

    at: float
    verb: str  # LIST or WATCH
    namespace: str
    params: dict
    status: int
    headers: dict = field(default_factory=dict)


@dataclass(eq=False)
class _Watch:
    namespace: str
    selector: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class FakeKube:
    def __init__(self, token: str | None = None, gone_as: str = "event") -> None:
        self.token = token
        self.gone_as = gone_as
        self.pods: dict[tuple[str, str], dict] = {}  # (namespace, name) -> pod
        self.version = 1000
        self.floor = 0  # watches from versions below this get 410
        self.history: list[tuple] = []  # (rv, namespace, type, pod, labels before)
        self.seen: list[Seen] = []
        self.failures: list[tuple[str, int]] = []  # (verb, status) for the next requests
        self._watches: set[_Watch] = set()
        self._connections: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # -- changing the cluster ---------------------------------------------------------------

    def _bump(self) -> int:
        self.version += 1
        return self.version

    def _emit(self, namespace: str, kind: str, pod: dict, quiet: bool,
              old_labels: dict | None = None) -> None:
        """Record and send an event. As the API server does for a selector watch, a pod
        whose labels enter the selector is ADDED to it, and one that leaves is DELETED."""
        if quiet:
            return
        snapshot = copy.deepcopy(pod)
        old_labels = snapshot["metadata"].get("labels") or {} if old_labels is None \
            else old_labels
        self.history.append((self.version, namespace, kind, snapshot, old_labels))
        for watch in self._watches:
            if watch.namespace == namespace:
                seen = self._as_seen_by(watch.selector, kind, snapshot, old_labels)
                if seen is not None:
                    watch.queue.put_nowait(seen)

    @staticmethod
    def _as_seen_by(selector: str, kind: str, pod: dict, old_labels: dict) -> dict | None:
        now = selector_matches(selector, pod["metadata"].get("labels") or {})
        before = selector_matches(selector, old_labels)
        if kind == "MODIFIED" and now != before:
            kind = "ADDED" if now else "DELETED"
        elif not now:
            return None
        return {"type": kind, "object": pod}

    def add(self, pod: dict, namespace: str = "default", quiet: bool = False) -> dict:
        """Create a pod (ADDED). `quiet` changes state without any watch event."""
        pod = copy.deepcopy(pod)
        pod["metadata"]["namespace"] = namespace
        pod["metadata"]["resourceVersion"] = str(self._bump())
        self.pods[(namespace, pod["metadata"]["name"])] = pod
        self._emit(namespace, "ADDED", pod, quiet)
        return pod

    def modify(self, name: str, change: Callable[[dict], None], namespace: str = "default",
               quiet: bool = False) -> dict:
        pod = self.pods[(namespace, name)]
        old_labels = dict(pod["metadata"].get("labels") or {})
        change(pod)
        pod["metadata"]["resourceVersion"] = str(self._bump())
        self._emit(namespace, "MODIFIED", pod, quiet, old_labels)
        return pod

    def set_ready(self, name: str, ready: bool, namespace: str = "default",
                  quiet: bool = False) -> dict:
        def change(pod: dict) -> None:
            pod["status"]["conditions"] = [
                {"type": "Ready", "status": "True" if ready else "False"}]
        return self.modify(name, change, namespace, quiet)

    def terminate(self, name: str, namespace: str = "default") -> dict:
        """A graceful delete begins: deletionTimestamp set, the pod still Running."""
        def change(pod: dict) -> None:
            pod["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
        return self.modify(name, change, namespace)

    def delete(self, name: str, namespace: str = "default", quiet: bool = False) -> None:
        pod = self.pods.pop((namespace, name))
        pod["metadata"]["resourceVersion"] = str(self._bump())
        self._emit(namespace, "DELETED", pod, quiet)

    def bookmark(self) -> int:
        """A BOOKMARK to every watch (`allowWatchBookmarks`), at a new version."""
        version = self._bump()
        for watch in self._watches:
            watch.queue.put_nowait({"type": "BOOKMARK", "object": {
                "kind": "Pod", "apiVersion": "v1",
                "metadata": {"resourceVersion": str(version)}}})
        return version

    def compact(self) -> None:
        """Forget the event history: older resourceVersions now get 410 Gone."""
        self.history.clear()
        self.floor = self.version

    def restore(self, version: int) -> None:
        """The API server restored from an older backup: its history starts again at
        `version` (the pods stay as they are now, their own versions rewritten)."""
        self.version = version
        self.history.clear()
        self.floor = 0
        for pod in self.pods.values():
            pod["metadata"]["resourceVersion"] = str(version)
        self.close_watches()

    def close_watches(self) -> None:
        for watch in self._watches:
            watch.queue.put_nowait(CLOSE)

    def abort_watches(self) -> None:
        for watch in self._watches:
            watch.queue.put_nowait(ABORT)

    def fail_next(self, verb: str, status: int, count: int = 1) -> None:
        self.failures.extend([(verb, status)] * count)

    def watching(self) -> int:
        return len(self._watches)

    def requests(self, verb: str) -> list[Seen]:
        return [s for s in self.seen if s.verb == verb]

    # -- HTTP --------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            await self._answer(head.decode("latin-1"), writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self._connections.discard(task)

    async def _answer(self, head: str, writer: asyncio.StreamWriter) -> None:
        lines = head.split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                key, value = line.split(":", 1)
                headers[key.strip().lower()] = value.strip()
        parts = urlsplit(target)
        params = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        verb = "WATCH" if params.get("watch") in ("1", "true") else "LIST"
        segments = [unquote(s) for s in parts.path.split("/")]
        # ['', 'api', 'v1', 'namespaces', ns, 'pods']
        if method != "GET" or len(segments) != 6 or segments[5] != "pods" \
                or not parts.path.startswith(PODS_PREFIX):
            await self._status(writer, 404, "NotFound", "no such path")
            return
        namespace = segments[4]
        seen = Seen(time.monotonic(), verb, namespace, params, 200, headers)
        self.seen.append(seen)
        if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
            seen.status = 401
            await self._status(writer, 401, "Unauthorized", "bad token")
            return
        for i, (fail_verb, status) in enumerate(self.failures):
            if fail_verb == verb:
                del self.failures[i]
                seen.status = status
                await self._status(writer, status, "InternalError", "injected failure")
                return
        selector = params.get("labelSelector", "")
        if verb == "LIST":
            await self._list(writer, namespace, selector)
            return
        raw = params.get("resourceVersion")
        since = int(raw) if raw else self.version  # "" = from now on
        if since > self.version:  # ahead of this server's history (an API restored from backup)
            seen.status = 504
            await self._status(writer, 504, "Timeout", f"Timeout: Too large resource version: "
                               f"{since}, current: {self.version}")
            return
        if since < self.floor:
            seen.status = 410
            if self.gone_as == "status":
                await self._status(writer, 410, "Expired", f"too old resource version: {since}")
            else:
                await self._stream(writer, [self._gone_event(since)], None, 0)
            return
        watch = _Watch(namespace, selector)
        backlog = [self._as_seen_by(selector, kind, pod, old_labels)
                   for rv, ns, kind, pod, old_labels in self.history
                   if rv > since and ns == namespace]
        backlog = [event for event in backlog if event is not None]
        self._watches.add(watch)
        try:
            await self._stream(writer, backlog, watch, float(params.get("timeoutSeconds", 60)))
        finally:
            self._watches.discard(watch)

    def _gone_event(self, since: int) -> dict:
        return {"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
            "code": 410, "message": f"too old resource version: {since} ({self.floor})"}}

    async def _list(self, writer: asyncio.StreamWriter, namespace: str, selector: str) -> None:
        items = [pod for (ns, _), pod in sorted(self.pods.items())
                 if ns == namespace and selector_matches(
                     selector, pod["metadata"].get("labels") or {})]
        body = json.dumps({"kind": "PodList", "apiVersion": "v1",
                           "metadata": {"resourceVersion": str(self.version)},
                           "items": items}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    async def _status(self, writer: asyncio.StreamWriter, code: int, reason: str,
                      message: str) -> None:
        body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                           "reason": reason, "code": code, "message": message}).encode()
        writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n"
                     % (code, reason.encode(), len(body)) + body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, backlog: list[dict],
                      watch: _Watch | None, timeout: float) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")

        def chunk(event: dict) -> bytes:
            data = json.dumps(event).encode() + b"\n"
            return b"%x\r\n%s\r\n" % (len(data), data)

        for event in backlog:
            writer.write(chunk(event))
        await writer.drain()
        if watch is not None:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    item = await asyncio.wait_for(watch.queue.get(),
                                                  max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    break
                if item is CLOSE:
                    break
                if item is ABORT:
                    writer.transport.abort()
                    return
                writer.write(chunk(item))
                await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


class ThreadedFakeKube:
    """The fake on its own loop in a thread, for tests whose client is another process."""

    def __init__(self, **kwargs) -> None:
        self.fake = FakeKube(**kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedFakeKube:
        self._thread.start()
        self.call(self.fake.start)
        return self

    def __exit__(self, *exc) -> None:
        self.call(self.fake.stop)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    @property
    def url(self) -> str:
        return self.fake.url

    def call(self, fn: Callable, *args, **kwargs):
        """Run `fn(*args, **kwargs)` (sync or async) on the fake's loop; return its result."""
        async def run():
            result = fn(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)
