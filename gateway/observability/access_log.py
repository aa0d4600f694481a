"""The access log (`--access-log PATH`, `-` for standard output): one JSON line per inference
request, written by a thread so that the event loop never waits on a disk.

The request path only appends the finished `usage.RequestUsage` to a deque (atomic under the
GIL, no lock) after a length check: when `QUEUE_LIMIT` lines wait, the line is dropped and
`gateway_access_log_dropped_total` counts it. The writer thread wakes every `INTERVAL`, turns
the records into JSON and writes whole lines on an O_APPEND descriptor, so the `--workers`
processes can share one file or pipe without tearing lines:
* a regular file takes one `write(2)` per batch (tens of KB): an appending write to a local file
  is not interleaved with another process's;
* anything else (a pipe or FIFO, as `-` is under a container runtime, systemd or `| tee`; a
  socket) takes pieces of whole lines, each at most `PIPE_BUF` (4,096) bytes: only such a write
  is atomic on a pipe. A batch in one write tore 313 of 4,931 lines with 2 workers and a slow
  reader (a larger write is split as the reader frees room, and the other worker's bytes land
  between its parts).
Decision: a line longer than `PIPE_BUF` (none in practice: a line is about 450 bytes, every
field bounded, the request id to 128 characters) is shortened on such a descriptor, its strings
cut and `"truncated": true` added, so it stays one parseable line. An `flock` to serialize the
writers instead cannot work for `-`: the workers inherit one open file description of standard
output, and flock locks belong to it, so every worker would hold the same lock.
When the file is renamed or removed (logrotate), the next batch goes to a new file at PATH.

A line holds no secret and no content: time, request id, tenant, model, endpoint, the pair,
status, times, token counts and retries. Never the key, the prompt or the answer.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import select
import stat
import threading

import orjson

from gateway.observability.usage import RequestUsage

log = logging.getLogger("gateway.observability.access_log")

QUEUE_LIMIT = 10_000  # lines waiting for the writer before new ones are dropped
INTERVAL = 0.2  # seconds between the writer's batches
WAIT = 5.0  # seconds a full non-blocking descriptor is waited for before the batch is dropped
STDOUT = "-"
PIPE_BUF = select.PIPE_BUF  # the largest write a pipe takes whole (4,096 bytes on Linux)
CUTS = (256, 16)  # the lengths strings are cut to, in turn, until a line fits its bound


def line_of(record: RequestUsage, bound: int | None = None) -> bytes:
    """The JSON line of one request (seconds as floats, counts as integers or null), at most
    `bound` bytes when one is given (strings cut, `"truncated": true`)."""
    fields = _fields(record)
    line = orjson.dumps(fields) + b"\n"
    for cut in CUTS:
        if bound is None or len(line) <= bound:
            break
        shortened = {k: v[:cut] if isinstance(v, str) and k != "time" else v
                     for k, v in fields.items()}
        line = orjson.dumps({**shortened, "truncated": True}) + b"\n"
    return line


def _fields(record: RequestUsage) -> dict:
    when = datetime.datetime.fromtimestamp(record.time, datetime.UTC)
    return {
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
    }


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
        self._regular = True  # a regular file takes a batch in one write; else PIPE_BUF pieces

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
        records = []
        while pending:
            records.append(pending.popleft())
        try:
            self._reopen_if_moved()
            bound = None if self._regular else PIPE_BUF
            self._write_lines([line_of(record, bound) for record in records])
            self._failing = False
        except OSError as exc:
            if not self._failing:
                log.warning("access log %s: %s; lines are dropped until it works again",
                            self.path, exc)
            self._failing = True
            if self.dropped is not None:
                self.dropped.inc(len(records))

    def _open(self) -> None:
        if self.path == STDOUT:
            self._fd = 1
            self._regular = stat.S_ISREG(os.fstat(1).st_mode)
            return
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        opened = os.fstat(self._fd)
        self._inode = (opened.st_dev, opened.st_ino)
        self._regular = stat.S_ISREG(opened.st_mode)

    def _reopen_if_moved(self) -> None:
        if self.path == STDOUT:
            return
        try:
            found = os.stat(self.path)
            current = (found.st_dev, found.st_ino)
        except FileNotFoundError:
            current = None
        if self._fd is None or current != self._inode:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._open()

    def _write_lines(self, lines: list[bytes]) -> None:
        """A regular file: the batch in one write. Else pieces of whole lines, each at most
        PIPE_BUF bytes (each line is, `line_of`): a pipe writes each whole, never interleaved
        with another worker's."""
        if self._regular:
            self._write_all(b"".join(lines))
            return
        piece: list[bytes] = []
        size = 0
        for line in lines:
            if piece and size + len(line) > PIPE_BUF:
                self._write_all(b"".join(piece))
                piece, size = [], 0
            piece.append(line)
            size += len(line)
        if piece:
            self._write_all(b"".join(piece))

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self._fd, view)
            except BlockingIOError:  # a non-blocking descriptor (someone's stdout): wait
                if not select.select([], [self._fd], [], WAIT)[1]:
                    raise
                continue
            view = view[written:]
