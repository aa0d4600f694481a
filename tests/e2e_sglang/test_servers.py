"""Real SGLang PD servers on CPU, talked to directly (no gateway): what the gateway relies on."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e_sglang.conftest import SglangCluster

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # the first test pays the start-up

GREEDY = {"temperature": 0, "max_new_tokens": 16}


def get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=60, trust_env=False)


def test_health_on_every_server(sglang_cluster: SglangCluster) -> None:
    for url in [*sglang_cluster.prefill_urls, *sglang_cluster.decode_urls, sglang_cluster.null_url]:
        assert get(url + "/health").status_code == 200, url


def test_server_info_reports_role_bootstrap_port_and_backend(sglang_cluster: SglangCluster) -> None:
    servers = [*sglang_cluster.prefill, *sglang_cluster.decode, sglang_cluster.null]
    for server in servers:
        info = get(server.url + "/server_info").json()
        expected_mode = "null" if server.role == "plain" else server.role
        assert info["disaggregation_mode"] == expected_mode, server.name
        assert info["disaggregation_transfer_backend"] == "mooncake"
        assert info["dp_size"] == 1 and info["page_size"] >= 1
        assert info["version"].startswith("0.5.23")
        assert isinstance(info["internal_states"], list)
        if server.role == "prefill":
            assert info["disaggregation_bootstrap_port"] == server.bootstrap_port


def test_models_endpoint_serves_the_model_name(sglang_cluster: SglangCluster) -> None:
    models = get(sglang_cluster.decode_urls[0] + "/v1/models").json()
    assert [model["id"] for model in models["data"]] == [sglang_cluster.model_name]


def test_v1_loads_shape(sglang_cluster: SglangCluster) -> None:
    for url, mode in [
        (sglang_cluster.prefill_urls[0], "prefill"),
        (sglang_cluster.decode_urls[0], "decode"),
    ]:
        loads = get(url + "/v1/loads?include=core,disagg,queues").json()["loads"]
        assert len(loads) == 1
        load = loads[0]
        for key in (
            "dp_rank",
            "num_running_reqs",
            "num_waiting_reqs",
            "num_used_tokens",
            "max_total_num_tokens",
            "token_usage",
        ):
            assert key in load, (key, load)
        assert load["disaggregation"]["mode"] == mode
        assert "queues" in load


@pytest.mark.parametrize("decode", [0, 1], ids=["decode-0", "decode-1"])
def test_pd_generate_matches_plain_server(sglang_cluster: SglangCluster, decode: int) -> None:
    body = {"text": "the quick brown fox jumps over the lazy dog", "sampling_params": GREEDY}
    reference = httpx.post(
        sglang_cluster.null_url + "/generate", json=body, timeout=120, trust_env=False
    ).json()
    prefill, answer = asyncio.run(sglang_cluster.pd_generate(body, decode=decode))
    assert prefill.status_code == 200 and answer.status_code == 200, answer.text
    assert prefill.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert answer.json()["output_ids"] == reference["output_ids"]
    assert answer.json()["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


def test_pd_streaming_ends_with_done(sglang_cluster: SglangCluster) -> None:
    body = {"text": "hello world", "sampling_params": GREEDY, "stream": True}
    _, answer = asyncio.run(sglang_cluster.pd_generate(body))
    assert answer.status_code == 200
    events = [
        line[len("data: ") :] for line in answer.text.splitlines() if line.startswith("data:")
    ]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


def test_concurrent_pd_requests_all_succeed(sglang_cluster: SglangCluster) -> None:
    async def many() -> list[tuple[httpx.Response, httpx.Response]]:
        bodies = [{"text": f"request number {i}", "sampling_params": GREEDY} for i in range(8)]
        return await asyncio.gather(
            *(sglang_cluster.pd_generate(body, decode=i % 2) for i, body in enumerate(bodies))
        )

    for prefill, answer in asyncio.run(many()):
        assert prefill.status_code == 200 and answer.status_code == 200, answer.text


def test_prefill_without_bootstrap_room_is_400(sglang_cluster: SglangCluster) -> None:
    response = httpx.post(
        sglang_cluster.prefill_urls[0] + "/generate",
        json={"text": "x", "sampling_params": GREEDY},
        timeout=60,
        trust_env=False,
    )
    assert response.status_code == 400
    assert "bootstrap room" in response.text
