"""The access log's writer thread: whole JSON lines, bounded, and logrotate-friendly."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.observability.access_log import AccessLog
from gateway.observability.usage import RequestUsage


def record(i: int) -> RequestUsage:
    r = RequestUsage(None, "chat", f"req-{i}", time.perf_counter())
    r.tenant, r.model, r.status, r.prompt, r.cached, r.completion = "acme", "m", 200, 9, 4, 3
    return r


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def dropped_counter():
    return Counter("dropped", "d", registry=CollectorRegistry())


def test_records_become_json_lines(tmp_path):
    path = tmp_path / "access.log"
    log = AccessLog(str(path), interval=0.02)
    log.start()
    try:
        for i in range(3):
            log.write(record(i))
        assert wait_for(lambda: path.exists() and len(path.read_text().splitlines()) == 3)
    finally:
        log.close()
    first = lines(path)[0]
    assert first["request_id"] == "req-0" and first["tenant"] == "acme"
    assert (first["prompt_tokens"], first["cached_tokens"], first["completion_tokens"]) == \
        (9, 4, 3)
    assert first["time"].endswith("Z") and "T" in first["time"]


def test_a_full_queue_drops_and_counts(tmp_path):
    path = tmp_path / "access.log"
    dropped = dropped_counter()
    log = AccessLog(str(path), dropped=dropped, limit=2, interval=60)  # the writer sleeps
    log.start()
    for i in range(5):
        log.write(record(i))
    log.close()  # writes what was queued
    assert [line["request_id"] for line in lines(path)] == ["req-0", "req-1"]
    assert dropped._value.get() == 3


def test_a_rotated_file_is_reopened(tmp_path):
    path = tmp_path / "access.log"
    log = AccessLog(str(path), interval=0.02)
    log.start()
    try:
        log.write(record(0))
        assert wait_for(lambda: path.exists() and path.read_text())
        path.rename(tmp_path / "access.log.1")
        log.write(record(1))
        assert wait_for(lambda: path.exists() and path.read_text())
    finally:
        log.close()
    assert [line["request_id"] for line in lines(path)] == ["req-1"]
    assert [line["request_id"] for line in lines(tmp_path / "access.log.1")] == ["req-0"]


def test_an_unwritable_path_fails_at_start(tmp_path):
    with pytest.raises(OSError):
        AccessLog(str(tmp_path / "missing-dir" / "access.log")).start()
