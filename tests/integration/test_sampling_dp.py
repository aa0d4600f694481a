"""Parallel sampling and DP ranks through the gateway, against simulators that follow SGLang
0.5.23 (backends/sim mirrors `_normalize_bootstrap_params`, `_handle_batch_request`,
`DataParallelController` and `_resolve_prefill_dp_rank`).

The naive n > 1 PD request the gateway used to send fails on the simulator, as it hangs on real
SGLang; the gateway's fan-out answers like one plain server does. Prefills with 4 DP ranks get
every rank used, and the decode finds each request's prefill rank.
"""

from __future__ import annotations

import concurrent.futures
import json
import os

import httpx
import orjson
import pytest

from tests.integration.conftest import sim_cluster

TIMEOUT = 30


@pytest.fixture(scope="module")
def dp_cluster(tmp_path_factory):
    with sim_cluster(tmp_path_factory.mktemp("logs"), n_prefill=2, n_decode=2, null=True,
                     sim_args=["--dp-size", "4", "--token-delay", "0"],
                     gateway_args=["--loads-interval", "0.2"]) as c:
        yield c


def objects(raw: bytes) -> list[dict]:
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]" and raw.count(b"[DONE]") == 1
    return [orjson.loads(e[len(b"data: "):]) for e in events[:-1]]


def test_the_old_naive_n2_pd_request_fails_on_the_simulator(dp_cluster):
    """What the gateway used to send: one n=2 request with a room per expanded item."""
    prefill, port = dp_cluster.prefill[0]
    body = {"text": "hello", "sampling_params": {"n": 2, "max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": [1000, 1004]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        legs = [pool.submit(httpx.post, url + "/generate", json=body, timeout=TIMEOUT)
                for url in (prefill, dp_cluster.decode[0])]
        statuses = [leg.result().status_code for leg in legs]
    assert any(status >= 400 for status in statuses), statuses


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_native_n2_matches_a_plain_server(dp_cluster, stream):
    body = {"text": ["tell me", "a story"], "stream": stream,
            "sampling_params": {"n": 2, "max_new_tokens": 5}}
    r = httpx.post(dp_cluster.gateway + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    plain = httpx.post(dp_cluster.null + "/generate", json={**body, "stream": False},
                       timeout=TIMEOUT).json()
    if stream:
        last: dict[int, dict] = {}
        for obj in objects(r.content):
            last[obj["index"]] = obj
        got = [last[i]["text"] for i in range(4)]
    else:
        got = [item["text"] for item in r.json()]
    assert got == [item["text"] for item in plain]  # prompt-major, greedy samples agree


def test_chat_n3_sampled_choices_are_distinct_and_usage_counts_the_prompt_once(dp_cluster):
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi there"}],
            "n": 3, "max_tokens": 6, "temperature": 0.9}
    r = httpx.post(dp_cluster.gateway + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in out["choices"]}) == 3
    plain = httpx.post(dp_cluster.null + "/v1/chat/completions", json=body,
                       timeout=TIMEOUT).json()
    assert out["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_completions_stream_n2_with_usage(dp_cluster):
    body = {"model": "sim-model", "prompt": ["one", "two"], "n": 2, "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(dp_cluster.gateway + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    chunks = objects(r.content)
    text: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
    assert sorted(text) == [0, 1, 2, 3]
    usage = chunks[-1]["usage"]
    plain = httpx.post(dp_cluster.null + "/v1/completions", json={**body, "stream": False},
                       timeout=TIMEOUT).json()
    assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_every_dp_rank_serves_and_every_pair_finds_its_rank(dp_cluster):
    before = {url: httpx.get(url + "/sim/stats", timeout=5).json()
              for url, _ in dp_cluster.prefill}
    with httpx.Client(timeout=TIMEOUT) as client:
        for _ in range(160):
            r = client.post(dp_cluster.gateway + "/generate", json={
                "text": f"{os.urandom(6).hex()} is unrelated to the others",
                "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text  # a wrong rank would time the pair out
    for url, _ in dp_cluster.prefill:
        stats = httpx.get(url + "/sim/stats", timeout=5).json()
        counts = [rank["requests"] - old["requests"]
                  for rank, old in zip(stats["dp_ranks"], before[url]["dp_ranks"], strict=True)]
        assert sum(counts) > 0
        assert min(counts) >= 0.15 * sum(counts), (url, counts)
    servers = httpx.get(dp_cluster.gateway + "/admin/servers", timeout=5).json()["servers"]
    prefill = [s for s in servers if s["role"] == "prefill"]
    assert all(s["dp_ranks"] == 4 and len(s["ranks"]) == 4 for s in prefill), json.dumps(prefill)
