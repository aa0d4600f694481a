"""Malformed and oversized requests in bulk against one gateway (1 prefill + 1 decode).

Every body must get a JSON error with a 4xx status (or 200 when a "wrong" value happens to be
acceptable), never a 5xx, never a hang; afterwards the gateway is as healthy as before.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.reliability.bodies import Case, all_cases
from tests.rigs.faults import running_rig, wait_until

MAX_BODY = 65_536
GATEWAY_ARGS = ("--max-body-bytes", str(MAX_BODY), "--response-timeout", "10")
DEADLINE = 10.0

def params() -> list:
    out = []
    for case in all_cases():
        out.append(pytest.param(case, id=case.name))
    return out


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    with running_rig(tmp_path_factory.mktemp("fuzz"), GATEWAY_ARGS, n_prefill=1,
                     n_decode=1) as rig:
        yield rig


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=DEADLINE + 5) as client:
        yield client


def assert_json_error(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert error["message"] and error["type"], response.text


@pytest.mark.parametrize("case", params())
def test_malformed_body_gets_a_4xx(rig, client, case: Case):
    started = time.monotonic()
    response = client.post(rig.gateway + case.path, content=case.body,
                           headers={"content-type": "application/json"})
    assert time.monotonic() - started < DEADLINE
    assert response.status_code < 500, response.text[:300]
    if case.must_reject or response.status_code != 200:
        assert 400 <= response.status_code < 500, response.text[:300]
        assert_json_error(response)


def chunks(size: int):
    for _ in range(size // 8192 + 1):
        yield b"x" * 8192


@pytest.mark.parametrize("how", ["content-length", "chunked", "huge-field"])
def test_oversized_body_gets_413_without_being_read(rig, client, how):
    url = rig.gateway + "/generate"
    started = time.monotonic()
    if how == "content-length":  # refused on the header alone
        response = client.post(url, content=b"{" + b" " * (4 * MAX_BODY) + b"}")
    elif how == "chunked":  # no length: refused once the limit is crossed
        response = client.post(url, content=chunks(4 * MAX_BODY))
    else:
        response = client.post(url, json={"text": "x" * (MAX_BODY + 1)})
    assert time.monotonic() - started < DEADLINE
    assert response.status_code == 413, response.text[:300]
    assert_json_error(response)
    assert rig.stats(rig.decode[0])["in_flight"] == 0


def test_parallel_sample_count_is_bounded_at_the_gateway(rig, client):
    received = rig.stats(rig.decode[0])["received"]
    response = client.post(rig.gateway + "/generate",
                           json={"text": "amplify", "sampling_params": {"n": 50_000}})
    assert 400 <= response.status_code < 500
    assert rig.stats(rig.decode[0])["received"] == received, "the request reached a server"


def test_rejected_requests_log_no_unretrieved_task_errors(rig, client):
    logged = rig.gateway_proc.log().count("never retrieved")
    for n in range(150):  # both legs refuse a non-string stop
        body = {"text": f"refused {n}", "sampling_params": {"stop": 5}}
        assert client.post(rig.gateway + "/generate", json=body).status_code == 400
    assert client.post(rig.gateway + "/generate", json={"text": "fine"}).status_code == 200
    assert rig.gateway_proc.log().count("never retrieved") == logged


def test_gateway_still_healthy_after_fuzz(rig, client):
    assert client.get(rig.gateway + "/health").status_code == 200
    assert client.get(rig.gateway + "/readiness").json()["ready"] is True
    response = client.post(rig.gateway + "/generate",
                           json={"text": "still fine", "sampling_params": {"max_new_tokens": 4}})
    assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 4
    wait_until(lambda: rig.in_flight() == 0, 10, "no request left in flight")
    assert all(rig.stats(s)["in_flight"] == 0 for s in rig.servers)
    assert all(s["usable"] and s["breaker"] == "closed" for s in rig.snapshots().values())
