"""Every gateway endpoint besides inference, against real simulated servers."""

from __future__ import annotations

import threading
import time

import httpx

from tests.rigs.faults import wait_until


def get(cluster, path, **kw):
    return httpx.get(cluster.gateway + path, timeout=30, **kw)


def test_health_and_readiness(fresh):
    assert get(fresh, "/health").status_code == 200
    r = get(fresh, "/readiness")
    assert r.status_code == 200
    assert r.json()["prefill_usable"] == 1 and r.json()["decode_usable"] == 2


def test_health_generate_runs_a_real_pd_request(fresh):
    before = sum(fresh.stats(u)["received"] for u in fresh.decode)
    assert get(fresh, "/health_generate").status_code == 200
    after = sum(fresh.stats(u)["received"] for u in fresh.decode)
    assert after == before + 1
    assert fresh.stats(fresh.prefill[0][0])["completed"] >= 1


def test_models_and_model_info(fresh):
    models = get(fresh, "/v1/models").json()
    assert models["data"][0]["id"]
    for path in ("/model_info", "/get_model_info"):
        info = get(fresh, path).json()
        assert "model_path" in info


def test_server_info_groups_servers_by_role(fresh):
    for path in ("/server_info", "/get_server_info"):
        info = get(fresh, path).json()
        assert [s["disaggregation_mode"] for s in info["prefill"]] == ["prefill"]
        assert [s["disaggregation_mode"] for s in info["decode"]] == ["decode", "decode"]
        assert info["gateway"]["prefill_policy"]


def test_flush_cache_reaches_every_server(fresh):
    r = httpx.post(fresh.gateway + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] and len(body["results"]) == 3
    for url in [fresh.prefill[0][0], *fresh.decode]:
        assert fresh.stats(url)["flush_count"] == 1


def test_abort_request_by_rid_stops_a_running_request(fresh):
    for url in fresh.decode:
        httpx.post(url + "/sim/faults", json={"first_token_delay": 10}, timeout=5)
    result = {}

    def run():
        result["r"] = httpx.post(fresh.gateway + "/generate",
                                 json={"text": "slow one", "rid": "abort-me"}, timeout=30)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)  # let the request reach the decode; the abort below ends it early
    t0 = time.monotonic()
    r = httpx.post(fresh.gateway + "/abort_request", json={"rid": "abort-me"}, timeout=30)
    thread.join(15)
    assert r.status_code == 200
    assert time.monotonic() - t0 < 5
    meta = result["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert sum(fresh.stats(u)["aborted"] for u in fresh.decode) == 1


def test_abort_request_stops_an_anthropic_messages_request(fresh):
    """SGLang's Anthropic conversion drops the rid, and it answers `success` to an abort of
    a rid it does not know: the abort did nothing (the request ran to its end) and said it
    worked. The gateway stops it itself: the client gets a 400 in Anthropic's shape, and the
    decode's leg is cancelled (its connection closed)."""
    for url in fresh.decode:
        httpx.post(url + "/sim/faults", json={"first_token_delay": 10}, timeout=5)
    received = sum(fresh.stats(u)["received"] for u in fresh.decode)
    cancelled = sum(fresh.stats(u)["cancelled"] for u in fresh.decode)
    result = {}

    def run():
        result["r"] = httpx.post(fresh.gateway + "/v1/messages", timeout=30, json={
            "model": "sim-model", "max_tokens": 8, "rid": "abort-this-message",
            "messages": [{"role": "user", "content": "slow one"}]})

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: sum(fresh.stats(u)["received"] for u in fresh.decode) > received, 10,
               "the request reached a decode")
    r = httpx.post(fresh.gateway + "/abort_request", json={"rid": "abort-this-message"},
                   timeout=30)
    thread.join(15)
    assert r.status_code == 200
    answer = result["r"]
    assert answer.status_code == 400, answer.text  # before: 200 after the 10 s delay
    assert answer.json()["type"] == "error" and "aborted" in answer.json()["error"]["message"]
    wait_until(lambda: sum(fresh.stats(u)["cancelled"] for u in fresh.decode) > cancelled, 10,
               "the decode's leg cancelled")


def test_metrics_exposed(fresh):
    httpx.post(fresh.gateway + "/generate", json={"text": "count me"}, timeout=30)
    text = get(fresh, "/metrics").text
    assert 'gateway_requests_total{endpoint="generate",status="200"}' in text
    assert "gateway_server_in_flight_requests" in text
    assert "gateway_cached_tokens_total" in text


def test_admin_lists_servers(fresh):
    servers = get(fresh, "/admin/servers").json()["servers"]
    assert {s["role"] for s in servers} == {"prefill", "decode"}
    assert all(s["usable"] for s in servers)


def test_admin_policies_show_names_options_and_figures(fresh):
    httpx.post(fresh.gateway + "/generate", json={"text": "route me"}, timeout=30)
    policies = get(fresh, "/admin/policies").json()
    assert policies["prefill"]["name"] == "auto"  # the default
    assert policies["decode"]["name"] == "auto"
    assert "match_threshold" in policies["prefill"]["options"]
    assert policies["prefill"]["stats"]["tree_size"] > 0  # it remembered where the prompt went
