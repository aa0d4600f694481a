"""The access log (`--access-log PATH`, `-` for standard output): one JSON line per inference
request, written by a thread so that the event loop never waits on a disk.

The request path only appends the finished `usage.RequestUsage` to a deque (atomic under the
GIL, no lock) after a length check: when `QUEUE_LIMIT` lines wait, the line is dropped and
`gateway_access_log_dropped_total` counts it. The writer thread wakes every `INTERVAL`, turns
the records into JSON and writes them with one `write(2)` per batch of whole lines on an
O_APPEND descriptor, so the `--workers` processes can share one file without tearing lines.
When the file is renamed or removed (logrotate), the next batch goes to a new file at PATH.

A line holds no secret and no content: time, request id, tenant, model, endpoint, the pair,
status, times, token counts and retries. Never the key, the prompt or the answer.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import threading

import orjson

from gateway.observability.usage import RequestUsage

log = logging.getLogger("gateway.observability.access_log")

QUEUE_LIMIT = 10_000  # lines waiting for the writer before new ones are dropped
INTERVAL = 0.2  # seconds between the writer's batches
STDOUT = "-"


def line_of(record: RequestUsage) -> bytes:
    """The JSON line of one request (seconds as floats, counts as integers or null)."""
    when = datetime.datetime.fromtimestamp(record.time, datetime.UTC)
    return orjson.dumps({
        "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "request_id": record.request_id,
        "tenant": record.tenant,
        "model": record.model,
        "endpoint": record.endpoint,
        "stream": record.stream,
        "prefill": record.prefill,
        "decode": record.decode,
        "status": record.status,
        "ttft_s": _rounded(record.ttft),
        "duration_s": _rounded(record.duration),
        "prompt_tokens": record.prompt,
        "cached_tokens": record.cached,
        "completion_tokens": record.completion,
        "attempts": record.attempts,
        "retries": record.retries,
        "failovers": record.failovers,
    }) + b"\n"


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


class AccessLog:
    """A bounded queue of finished requests and the thread that writes them."""

    def __init__(self, path: str, dropped=None, limit: int = QUEUE_LIMIT,
                 interval: float = INTERVAL) -> None:
        self.path = path
        self.dropped = dropped  # a (buffered) counter: lines that never reached the file
        self.limit = limit
        self.interval = interval
        self._pending: collections.deque[RequestUsage] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._failing = False

    def start(self) -> None:
        self._open()  # a path that cannot be opened fails the start, not the first request
        self._thread = threading.Thread(target=self._run, name="access-log", daemon=True)
        self._thread.start()

    def write(self, record: RequestUsage) -> None:
        """Queue one finished request (the event loop: no I/O, no lock)."""
        if len(self._pending) >= self.limit:
            if self.dropped is not None:
                self.dropped.inc()
            return
        self._pending.append(record)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued and stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._fd is not None and self.path != STDOUT:
            os.close(self._fd)
        self._fd = None

    # -- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._drain()
        self._drain()

    def _drain(self) -> None:
        pending = self._pending
        if not pending:
            return
        lines = []
        while pending:
            lines.append(line_of(pending.popleft()))
        data = b"".join(lines)
        try:
            self._reopen_if_moved()
            self._write_all(data)
            self._failing = False
        except OSError as exc:
            if not self._failing:
                log.warning("access log %s: %s; lines are dropped until it works again",
                            self.path, exc)
            self._failing = True
            if self.dropped is not None:
                self.dropped.inc(len(lines))

    def _open(self) -> None:
        if self.path == STDOUT:
            self._fd = 1
            return
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        stat = os.fstat(self._fd)
        self._inode = (stat.st_dev, stat.st_ino)

    def _reopen_if_moved(self) -> None:
        if self.path == STDOUT:
            return
        try:
            stat = os.stat(self.path)
            current = (stat.st_dev, stat.st_ino)
        except FileNotFoundError:
            current = None
        if self._fd is None or current != self._inode:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._open()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
