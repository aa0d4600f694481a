"""Failing legs, disconnecting clients and bad input: nothing hangs, errors are clear."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.conftest import sim_cluster
from tests.procs import free_port, python, running


def fault(url, **knobs):
    httpx.post(url + "/sim/faults", json=knobs, timeout=5).raise_for_status()


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_failing_prefill_fails_fast_and_cancels_decode(fresh):
    prefill = fresh.prefill[0][0]
    fault(prefill, error_rate=1.0)
    t0 = time.monotonic()
    r = httpx.post(fresh.gateway + "/generate", json={"text": "doomed"}, timeout=30)
    elapsed = time.monotonic() - t0
    assert r.status_code == 502
    assert "prefill server" in r.json()["error"]["message"]
    assert elapsed < 1.0, f"took {elapsed:.2f}s: the decode leg was waited for"
    # each attempt's decode leg was cancelled, not left waiting for KV
    assert wait_for(lambda: sum(fresh.stats(u)["in_flight"] for u in fresh.decode) == 0)
    ended = sum(fresh.stats(u)["cancelled"] + fresh.stats(u)["aborted"] for u in fresh.decode)
    assert ended >= 1


def test_client_disconnect_cancels_both_legs(fresh):
    prefill = fresh.prefill[0][0]
    fault(prefill, hang=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fresh.gateway + "/generate", json={"text": "bye"}, timeout=httpx.Timeout(
            5, read=0.5))
    assert wait_for(lambda: fresh.stats(prefill)["cancelled"] >= 1)
    assert wait_for(lambda: sum(fresh.stats(u)["cancelled"] + fresh.stats(u)["aborted"]
                                for u in fresh.decode) >= 1)
    assert wait_for(lambda: sum(fresh.stats(u)["in_flight"] for u in fresh.decode) == 0)


def test_stream_disconnect_mid_stream_cancels_decode(tmp_path):
    with sim_cluster(tmp_path, sim_args=["--token-delay", "0.1"]) as slow:
        with httpx.stream("POST", slow.gateway + "/generate", timeout=10,
                          json={"text": "long", "stream": True,
                                "sampling_params": {"max_new_tokens": 100}}) as r:
            for chunk in r.iter_raw():
                if chunk:
                    break
        assert wait_for(lambda: sum(slow.stats(u)["cancelled"] + slow.stats(u)["aborted"]
                                    for u in slow.decode) >= 1)
        assert wait_for(lambda: sum(slow.stats(u)["in_flight"] for u in slow.decode) == 0)


@pytest.mark.parametrize(
    "method, path, kwargs, status",
    [
        ("POST", "/generate", {"content": b"{not json"}, 400),
        ("POST", "/generate", {"json": {"text": 42}}, 400),
        ("POST", "/generate", {"json": {"sampling_params": {}}}, 400),
        ("POST", "/v1/chat/completions", {"json": {"messages": "hi"}}, 400),
        ("POST", "/v1/completions", {"json": {"prompt": {"a": 1}}}, 400),
        ("POST", "/v1/completions", {"content": b"x" * 2_000_000}, 413),
        ("GET", "/v1/unknown", {}, 404),
        ("GET", "/generate", {}, 405),
    ],
    ids=["invalid-json", "wrong-type", "missing-text", "messages-not-list", "prompt-object",
         "huge-body", "unknown-route", "wrong-method"],
)
def test_bad_input_gets_json_4xx(fresh, method, path, kwargs, status):
    r = httpx.request(method, fresh.gateway + path, timeout=30, **kwargs)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert sum(fresh.stats(u)["received"] for u in fresh.decode) == 0


def test_a_server_in_the_other_role_is_served_in_the_role_it_runs(fresh, tmp_path):
    """A role switch (by an admin, or by --rebalance) outlives the command line: the gateway
    started again with the old flags serves the server in its live role, and says so (it used
    to exit 3, so a gateway that had rebalanced could never restart)."""
    port = free_port()
    switched = fresh.decode[0]  # given as a prefill, runs as a decode
    argv = python("-m", "gateway", "--prefill", fresh.prefill[0][0], "--prefill", switched,
                  "--decode", fresh.decode[1], "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    with running("gw-other-role", argv, tmp_path, url + "/readiness") as proc:
        listed = httpx.get(url + "/admin/servers", timeout=10).json()["servers"]
        assert {s["url"]: s["role"] for s in listed}[switched] == "decode"
        r = httpx.post(url + "/admin/servers/drain", json={"url": fresh.decode[1], "timeout": 5},
                       timeout=10)
        assert r.status_code == 200, r.text  # the switched server is the only decode left
        before = fresh.stats(switched)["received"]
        for i in range(3):
            r = httpx.post(url + "/generate", json={"text": f"served {i}"}, timeout=30)
            assert r.status_code == 200, r.text
        assert fresh.stats(switched)["received"] >= before + 3  # a decode it is
        assert f"{switched} was given as a prefill server but runs with " \
               "--disaggregation-mode decode" in proc.log()
        assert "serving it as a decode server" in proc.log()


def test_bootstrap_port_read_from_server_info(fresh, tmp_path):
    port = free_port()
    argv = python("-m", "gateway", "--prefill", fresh.prefill[0][0], "--decode", fresh.decode[0],
                  "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    with running("gw-no-port", argv, tmp_path, url + "/readiness"):
        r = httpx.post(url + "/generate", json={"text": "auto port"}, timeout=30)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--decode", "http://127.0.0.1:1"], "at least one prefill"),
        (["--prefill", "nonsense", "--decode", "http://127.0.0.1:1"], "not a URL"),
        (["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--bogus"],
         "unrecognized arguments"),
    ],
    ids=["no-prefill", "bad-url", "unknown-flag"],
)
def test_cli_errors_exit_2(tmp_path, argv, message):
    with running("gw-bad-cli", python("-m", "gateway", *argv), tmp_path, None) as proc:
        assert proc.popen.wait(30) == 2
        assert message in proc.log()
