"""Admission control and API keys on one gateway:
--max-concurrency 2 --max-queue 2 --queue-timeout 1 --api-keys K1 --admin-api-keys A1.

A burst of 8 slow requests: 2 run, 2 wait in the queue and give up after 1 s (503 with
Retry-After), the others find the queue full (429 with Retry-After at once); both counted in
gateway_admission_rejections_total. Keys: inference routes want K1, admin routes want A1.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest

from tests.procs import HOST, Proc, free_port, python
from tests.rigs.faults import running_rig, wait_until

KEY, ADMIN_KEY = "K1", "A1"
BURST = 8
QUEUE_TIMEOUT = 1.0
GATEWAY_ARGS = ("--max-concurrency", "2", "--max-queue", "2",
                "--queue-timeout", str(QUEUE_TIMEOUT), "--api-keys", KEY,
                "--admin-api-keys", ADMIN_KEY)
AUTH = {"authorization": f"Bearer {KEY}"}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
SLOW = {"text": "slow", "sampling_params": {"max_new_tokens": 30}}  # 30 x 0.1 s = 3 s


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    with running_rig(tmp_path_factory.mktemp("admission"), GATEWAY_ARGS, n_prefill=1,
                     n_decode=1, sim_args=("--token-delay", "0.1")) as rig:
        rig.admin_headers = ADMIN
        yield rig


@pytest.mark.timeout(60)
def test_burst_gets_429_and_503_with_retry_after(rig, timing):
    barrier = threading.Barrier(BURST)
    answers: list[tuple[int, str | None, float, dict]] = []
    lock = threading.Lock()

    def one() -> None:
        with httpx.Client(timeout=30) as client:
            barrier.wait(10)
            started = time.monotonic()
            r = client.post(rig.gateway + "/generate", json=SLOW, headers=AUTH)
            with lock:
                answers.append((r.status_code, r.headers.get("retry-after"),
                                time.monotonic() - started, r.json()))

    threads = [threading.Thread(target=one) for _ in range(BURST)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    statuses = Counter(status for status, *_ in answers)
    assert len(answers) == BURST and statuses[200] == 2, statuses
    assert statuses[429] + statuses[503] == BURST - 2 and statuses[503] >= 2, statuses
    for status, retry_after, took, body in answers:
        if status == 429:
            assert retry_after == "1" and body["error"]["type"] == "rate_limit_error"
            assert took < QUEUE_TIMEOUT, "queue full is answered at once"
            timing("burst over --max-queue", "429 answered after", took)
        elif status == 503:
            assert retry_after == "2" and body["error"]["type"] == "service_unavailable"
            assert QUEUE_TIMEOUT - 0.05 <= took < QUEUE_TIMEOUT + 2
            timing("burst over --max-concurrency", "503 (queue timeout) after", took)
    metrics = rig.metrics()
    name = "gateway_admission_rejections_total"
    assert metrics.total(name, reason="queue_full") == statuses[429]
    assert metrics.total(name, reason="queue_timeout") == statuses[503]
    wait_until(lambda: rig.in_flight() == 0, 10, "slots released")
    fine = httpx.post(rig.gateway + "/generate", headers=AUTH, timeout=30,
                      json={"text": "after", "sampling_params": {"max_new_tokens": 2}})
    assert fine.status_code == 200, "the slots and the queue are free again"


@pytest.mark.parametrize("headers, status", [
    ({}, 401),
    ({"authorization": "Bearer wrong"}, 401),
    ({"authorization": f"Bearer {ADMIN_KEY}"}, 401),
    ({"authorization": f"Bearer {KEY}"}, 200),
    ({"x-api-key": KEY}, 200),
], ids=["no-key", "wrong-key", "admin-key", "bearer", "x-api-key"])
def test_inference_needs_the_api_key(rig, headers, status):
    r = httpx.post(rig.gateway + "/generate", headers=headers, timeout=30,
                   json={"text": "key", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("method, path", [
    ("GET", "/admin/servers"), ("POST", "/admin/servers/drain"), ("DELETE", "/admin/servers"),
    ("POST", "/flush_cache"), ("GET", "/dashboard/data"),
], ids=["list", "drain", "remove", "flush", "dashboard-data"])
@pytest.mark.parametrize("headers, allowed", [
    ({}, False), ({"authorization": f"Bearer {KEY}"}, False), (ADMIN, True),
], ids=["no-key", "inference-key", "admin-key"])
def test_admin_routes_need_the_admin_key(rig, method, path, headers, allowed):
    body = {"url": "http://127.0.0.1:1"}  # an unknown server: 404 once authorised
    r = httpx.request(method, rig.gateway + path, headers=headers, timeout=30,
                      json=body if method != "GET" else None)
    if allowed:
        assert r.status_code in (200, 404), r.text
    elif headers:  # a valid key without the role: forbidden, not unknown
        assert r.status_code == 403, r.text
        assert r.json()["error"]["type"] == "permission_error"
    else:
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"


def test_open_routes_need_no_key(rig):
    for path in ("/health", "/readiness", "/metrics"):
        assert httpx.get(rig.gateway + path, timeout=10).status_code == 200, path


def test_singular_api_key_flag_is_accepted(tmp_path):
    port = free_port()
    proc = Proc("gateway-api-key", python(
        "-m", "gateway", "--api-key", KEY, "--host", HOST, "--port", str(port),
        "--prefill", f"http://{HOST}:{free_port()}", "--decode", f"http://{HOST}:{free_port()}",
        "--probe-timeout", "0.5"), tmp_path)
    try:
        proc.wait_http(f"http://{HOST}:{port}/health", 30)  # raises if it exited instead
    finally:
        proc.stop()
