"""The access log on a pipe shared by several workers (`--workers N --access-log -` under a
container runtime): every line arrives whole, however slowly the pipe is read.

A pipe writes at most PIPE_BUF bytes in one piece; a batch written at once (tens of KB) was
split as the reader freed room and the other process's bytes landed between its parts."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.observability.access_log import PIPE_BUF, AccessLog, line_of
from gateway.observability.usage import RequestUsage

ROOT = Path(__file__).resolve().parents[3]
WRITERS = 2
RECORDS = 1500  # per writer: about 1.5 x 450 KB in all, batches of about 100 KB
DEADLINE = 60.0  # seconds for the whole exchange

# One writer process: an AccessLog on `path` ("-": its standard output), fed in bursts so that
# each of its batches is far larger than PIPE_BUF.
WRITER = """
import sys, time
from gateway.observability.access_log import AccessLog
from gateway.observability.usage import RequestUsage
name, path, records = sys.argv[1], sys.argv[2], int(sys.argv[3])
log = AccessLog(path, interval=0.05)
log.start()
for i in range(records):
    r = RequestUsage(None, "chat", f"{name}-{i:04d}-" + "r" * 110, time.perf_counter())
    r.tenant, r.model, r.status = "acme", "m", 200
    r.prefill, r.decode = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
    log.write(r)
    if i % 200 == 199:
        time.sleep(0.1)  # let a batch of 200 lines (90 KB) build up
log.close(timeout=30)
"""


def read_slowly(fd: int, writers: list[subprocess.Popen]) -> bytes:
    """Every line the writers write, read in small bites with pauses, so that the pipe stays
    full and a large write goes through in parts; bounded by DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    data = bytearray()
    lines = 0
    try:
        while lines < WRITERS * RECORDS:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"{lines} lines within {DEADLINE} s"
            chunk = os.read(fd, 1024)
            assert chunk, f"the writers closed the pipe after {lines} lines"
            data.extend(chunk)
            lines += chunk.count(b"\n")
            time.sleep(0.0005)
    except BaseException:
        for writer in writers:
            writer.kill()
        raise
    return bytes(data)


def spawn(name: str, path: str, stdout: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, name, path, str(RECORDS)], cwd=ROOT,
                            stdout=stdout, stderr=subprocess.PIPE)


def check_lines(data: bytes, writers: list[subprocess.Popen]) -> None:
    for writer in writers:
        _, err = writer.communicate(timeout=30)
        assert writer.returncode == 0, err.decode()
    torn = []
    ids = set()
    for line in data.split(b"\n")[:-1]:
        try:
            ids.add(json.loads(line)["request_id"])
        except ValueError:
            torn.append(line)
    assert not torn, f"{len(torn)} torn lines, e.g. {torn[0][:120]!r}"
    assert len(ids) == WRITERS * RECORDS and data.endswith(b"\n")


def test_workers_sharing_a_pipe_as_stdout_never_tear_a_line():
    read_end, write_end = os.pipe()
    try:
        writers = [spawn(f"w{n}", "-", write_end) for n in range(WRITERS)]
    finally:
        os.close(write_end)  # the writers hold it now
    try:
        data = read_slowly(read_end, writers)
    finally:
        os.close(read_end)
    check_lines(data, writers)


def test_workers_sharing_a_fifo_never_tear_a_line(tmp_path):
    fifo = tmp_path / "access.fifo"
    os.mkfifo(fifo)
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the writers' opens never wait
    os.set_blocking(read_end, True)
    writers = [spawn(f"w{n}", str(fifo), subprocess.DEVNULL) for n in range(WRITERS)]
    try:
        data = read_slowly(read_end, writers)
    finally:
        os.close(read_end)
    check_lines(data, writers)


@pytest.mark.parametrize("field", ["request_id", "tenant", "model", "prefill", "decode"])
def test_a_line_longer_than_pipe_buf_is_cut_to_one_parseable_line(field):
    record = RequestUsage(None, "chat", "req-1", time.perf_counter())
    record.tenant, record.model, record.status = "acme", "m", 200
    setattr(record, field, "\x01" * 2 * PIPE_BUF)  # escaped: 6 bytes each in JSON
    assert len(line_of(record)) > PIPE_BUF  # unbounded: a regular file gets it whole
    line = line_of(record, PIPE_BUF)
    parsed = json.loads(line)
    assert len(line) <= PIPE_BUF and parsed["truncated"] is True
    assert parsed["status"] == 200 and parsed["time"].endswith("Z")


def long_record() -> RequestUsage:
    record = RequestUsage(None, "chat", "req-1", time.perf_counter())
    record.tenant, record.model, record.status = "acme", "m" * 3 * PIPE_BUF, 200
    return record


def test_a_long_line_is_cut_on_a_fifo_and_kept_whole_in_a_file(tmp_path):
    fifo, path = tmp_path / "access.fifo", tmp_path / "access.log"
    os.mkfifo(fifo)
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        for target in (fifo, path):
            log = AccessLog(str(target), interval=60)
            log.start()
            log.write(long_record())
            log.close()
        piped = os.read(read_end, 4 * PIPE_BUF)
    finally:
        os.close(read_end)
    assert len(piped) <= PIPE_BUF and json.loads(piped)["truncated"] is True
    kept = path.read_bytes()
    assert len(kept) > 3 * PIPE_BUF and "truncated" not in json.loads(kept)
