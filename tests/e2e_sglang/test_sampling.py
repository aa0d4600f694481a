"""Parallel sampling (n > 1) through the gateway, against real SGLang 0.5.23 PD servers on CPU.

SGLang cannot serve n > 1 in PD mode (one room for n + 1 requests, docs/FIDELITY.md); the
gateway sends n single-sample PD requests and merges them (gateway/samples.py). Every answer
here is compared with what the plain (`--disaggregation-mode null`) server answers to the same
request: greedy samples are equal, so texts, order (prompt-major: item `i*n + j` is sample j of
prompt i), indices and usage (prompt tokens once per prompt) must match exactly.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx
import pytest

from tests.e2e_sglang.conftest import SglangCluster

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # the first test pays the start-up

N = 2
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog"]
TOKENS = [[74, 75, 427, 262], [437, 400, 286]]  # token ids of the tiny model's vocabulary
MODEL = "tiny-llama"
IDLE_WAIT = 15.0  # seconds the servers get to report no running or waiting request


def post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url, json=body, timeout=timeout, trust_env=False)


def whole(url: str, path: str, body: dict) -> Any:
    response = post(url + path, body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    """The JSON objects of an SSE answer, checked: 200, text/event-stream, every event a JSON
    object, exactly one `[DONE]`, and it comes last."""
    response = post(url + path, body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data:"):].strip() for line in response.text.splitlines()
              if line.startswith("data:")]
    assert events and events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
    objects = [json.loads(event) for event in events[:-1]]
    assert all(isinstance(o, dict) and "error" not in o for o in objects), objects
    return objects


def both(cluster: SglangCluster, path: str, body: dict, streamed: bool) -> tuple[Any, Any]:
    """(gateway's answer, plain server's answer) to the same request."""
    get = stream if streamed else whole
    return get(cluster.gateway, path, body), get(cluster.null_url, path, body)


def usage_counts(usage: dict) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


# -- /v1/chat/completions ---------------------------------------------------------------------

def chat_choices(objects: list[dict]) -> tuple[dict[int, dict], dict | None]:
    """Per index: its content, role and finish reasons, from a chat stream; and the usage."""
    choices: dict[int, dict] = {}
    usage = None
    for obj in objects:
        assert obj["object"] == "chat.completion.chunk"
        if not obj["choices"]:
            assert usage is None, "two usage chunks"
            usage = obj["usage"]
            continue
        assert len(obj["choices"]) == 1  # one choice per chunk, as SGLang sends them
        choice = obj["choices"][0]
        seen = choices.setdefault(choice["index"], {"content": "", "roles": [], "finish": []})
        delta = choice["delta"]
        seen["content"] += delta.get("content") or ""
        if delta.get("role"):
            seen["roles"].append(delta["role"])
        if choice["finish_reason"]:
            seen["finish"].append(choice["finish_reason"])
    return choices, usage


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
def test_chat_n2_equals_plain_server(sglang_cluster: SglangCluster, streamed: bool) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": TEXTS[1]}], "n": N,
            "max_tokens": 8, "temperature": 0}
    if streamed:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    got, want = both(sglang_cluster, "/v1/chat/completions", body, streamed)
    if not streamed:
        assert [c["index"] for c in got["choices"]] == list(range(N))
        assert [c["message"]["content"] for c in got["choices"]] == \
            [c["message"]["content"] for c in want["choices"]]
        assert [c["finish_reason"] for c in got["choices"]] == \
            [c["finish_reason"] for c in want["choices"]]
        assert usage_counts(got["usage"]) == usage_counts(want["usage"])
        assert isinstance(got["id"], str) and got["object"] == "chat.completion"
        return
    got_choices, got_usage = chat_choices(got)
    want_choices, want_usage = chat_choices(want)
    assert sorted(got_choices) == list(range(N))
    for index, seen in got_choices.items():
        assert seen["roles"] == ["assistant"], seen
        assert len(seen["finish"]) == 1, seen
        assert seen["content"] == want_choices[index]["content"]
    assert got_usage is not None and usage_counts(got_usage) == usage_counts(want_usage)


def test_chat_n2_sampled_answers_are_valid(sglang_cluster: SglangCluster) -> None:
    """temperature 1: each sample is its own (they may differ); the answer stays well formed,
    and the prompt is counted once."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": TEXTS[0]}], "n": N,
            "max_tokens": 8, "temperature": 1.0}
    got, want = both(sglang_cluster, "/v1/chat/completions", body, False)
    assert [c["index"] for c in got["choices"]] == list(range(N))
    for choice in got["choices"]:
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("length", "stop")
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert 0 < got["usage"]["completion_tokens"] <= N * body["max_tokens"]
    print("sampled chat contents:", [c["message"]["content"] for c in got["choices"]])


# -- /v1/completions ----------------------------------------------------------------------------

def completion_choices(objects: list[dict]) -> tuple[dict[int, dict], dict | None]:
    """Per index: text, logprob tokens and values, finish reasons, from a completions stream."""
    choices: dict[int, dict] = {}
    usage = None
    for obj in objects:
        assert obj["object"] == "text_completion"
        if not obj["choices"]:
            assert usage is None, "two usage chunks"
            usage = obj["usage"]
            continue
        for choice in obj["choices"]:
            seen = choices.setdefault(choice["index"], {"text": "", "tokens": [], "values": [],
                                                        "finish": []})
            seen["text"] += choice["text"]
            if choice.get("logprobs"):
                seen["tokens"] += choice["logprobs"]["tokens"]
                seen["values"] += choice["logprobs"]["token_logprobs"]
            if choice["finish_reason"]:
                seen["finish"].append(choice["finish_reason"])
    return choices, usage


def whole_completion_choices(answer: dict) -> dict[int, dict]:
    return {c["index"]: {"text": c["text"], "finish": [c["finish_reason"]],
                         "tokens": (c["logprobs"] or {}).get("tokens", []),
                         "values": (c["logprobs"] or {}).get("token_logprobs", [])}
            for c in answer["choices"]}


def assert_logprobs_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None), (got, want)
        if a is not None:
            assert a == pytest.approx(b, abs=0.05)


COMPLETION_CASES = {
    "batch-echo-logprobs": {"prompt": TEXTS, "echo": True, "logprobs": 1},
    "batch": {"prompt": TEXTS},
    "token-prompt": {"prompt": TOKENS[0]},
    "token-prompt-batch": {"prompt": TOKENS},
}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_completions_n2_equals_plain_server(sglang_cluster: SglangCluster, case: str,
                                            streamed: bool) -> None:
    prompts = COMPLETION_CASES[case]["prompt"]
    batch = len(prompts) if isinstance(prompts[0], (str, list)) else 1
    body = {"model": MODEL, "n": N, "max_tokens": 6, "temperature": 0,
            **COMPLETION_CASES[case]}
    if streamed:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    got, want = both(sglang_cluster, "/v1/completions", body, streamed)
    if streamed:
        (got_choices, got_usage), (want_choices, want_usage) = \
            completion_choices(got), completion_choices(want)
    else:
        assert [c["index"] for c in got["choices"]] == list(range(batch * N))
        got_choices, got_usage = whole_completion_choices(got), got["usage"]
        want_choices, want_usage = whole_completion_choices(want), want["usage"]
    assert sorted(got_choices) == list(range(batch * N))  # prompt-major: i*n + j
    for index, seen in got_choices.items():
        ref = want_choices[index]
        assert seen["text"] == ref["text"], index
        assert len(seen["finish"]) == 1 and seen["finish"] == ref["finish"]
        assert seen["tokens"] == ref["tokens"], index
        assert_logprobs_close(seen["values"], ref["values"])
        if body.get("echo"):
            assert seen["text"].startswith(prompts[index // N])
            assert seen["values"][0] is None  # the first prompt token has no logprob
    assert got_usage is not None and usage_counts(got_usage) == usage_counts(want_usage)


# -- native /generate ------------------------------------------------------------------------------

GENERATE_CASES = {
    "text": {"text": TEXTS[0]},
    "text-batch": {"text": TEXTS},
    "input-ids": {"input_ids": TOKENS[0]},
    "input-ids-batch": {"input_ids": TOKENS},
    "return-logprob": {"text": TEXTS[1], "return_logprob": True, "logprob_start_len": 0,
                       "top_logprobs_num": 2},
    "return-logprob-batch": {"text": TEXTS, "return_logprob": True},
}


def assert_same_item(got: dict, want: dict) -> None:
    assert got["output_ids"] == want["output_ids"]
    assert got["text"] == want["text"]
    meta, ref = got["meta_info"], want["meta_info"]
    assert meta["prompt_tokens"] == ref["prompt_tokens"]
    assert meta["completion_tokens"] == ref["completion_tokens"]
    assert meta["finish_reason"] == ref["finish_reason"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        if key not in ref:
            assert key not in meta
            continue
        assert [t[1] for t in meta[key]] == [t[1] for t in ref[key]], key
        assert_logprobs_close([t[0] for t in meta[key]], [t[0] for t in ref[key]])
    if "output_top_logprobs" in ref:
        assert len(meta["output_top_logprobs"]) == len(ref["output_top_logprobs"])


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_n2_equals_plain_server(sglang_cluster: SglangCluster, case: str,
                                         streamed: bool) -> None:
    prompt = GENERATE_CASES[case]
    batch_of = prompt.get("text", prompt.get("input_ids"))
    batch = len(batch_of) if isinstance(batch_of, list) and isinstance(batch_of[0], (str, list)) \
        else 1
    body = {**prompt, "sampling_params": {"n": N, "max_new_tokens": 6, "temperature": 0},
            "stream": streamed}
    got, _ = both(sglang_cluster, "/generate", body, streamed)
    want = whole(sglang_cluster.null_url, "/generate", {**body, "stream": False})
    assert isinstance(want, list) and len(want) == batch * N  # a single prompt too (n > 1)
    if not streamed:
        assert isinstance(got, list) and len(got) == batch * N
        for item in got:
            assert "index" not in item  # SGLang's whole native items carry no index
        ids = [item["meta_info"]["id"] for item in got]
        assert len(set(ids)) == len(ids), ids  # every sample has its own request id
        for g, w in zip(got, want, strict=True):
            assert_same_item(g, w)
        return
    last: dict[int, dict] = {}
    for event in got:
        index = event["index"]
        assert index in range(batch * N), event
        if index in last:
            assert last[index]["meta_info"]["finish_reason"] is None  # nothing after the end
            assert event["meta_info"]["id"] == last[index]["meta_info"]["id"]
        last[index] = event
    assert sorted(last) == list(range(batch * N))
    for index, event in last.items():
        assert event["meta_info"]["finish_reason"] is not None
        assert event["output_ids"] == want[index]["output_ids"]  # cumulative, like SGLang
        assert event["text"] == want[index]["text"]
        assert event["meta_info"]["prompt_tokens"] == want[index]["meta_info"]["prompt_tokens"]


def test_generate_n2_sampled_items_are_valid(sglang_cluster: SglangCluster) -> None:
    body = {"text": TEXTS, "sampling_params": {"n": N, "max_new_tokens": 8,
                                               "temperature": 1.0, "ignore_eos": True}}
    got = whole(sglang_cluster.gateway, "/generate", body)
    want = whole(sglang_cluster.null_url, "/generate", body)
    assert len(got) == len(TEXTS) * N
    for position, item in enumerate(got):
        assert len(item["output_ids"]) == 8
        assert item["meta_info"]["completion_tokens"] == 8
        assert item["meta_info"]["prompt_tokens"] == want[position]["meta_info"]["prompt_tokens"]
    print("sampled output ids:", [item["output_ids"] for item in got])


# -- latency and cleanup ------------------------------------------------------------------------------

def test_n2_takes_about_the_time_of_n1(sglang_cluster: SglangCluster) -> None:
    """The samples run in parallel: n=2 costs about one request, not two in a row (plus the
    wait for sample 0's prefill, which the others follow). Interleaved runs, medians."""
    prompt = "once upon a time there was a little tiny model on a cpu"
    params = {"max_new_tokens": 48, "temperature": 0.8, "ignore_eos": True}
    times: dict[int, list[float]] = {1: [], 2: []}
    for round_ in range(9):  # 2 warm-up rounds (a server restarted just before is slow)
        for n in (1, 2):
            start = time.monotonic()
            answer = post(sglang_cluster.gateway + "/generate",
                          {"text": prompt, "sampling_params": {**params, "n": n}})
            if round_ >= 2:
                times[n].append(time.monotonic() - start)
            assert answer.status_code == 200, answer.text
            items = answer.json() if n > 1 else [answer.json()]
            assert [len(item["output_ids"]) for item in items] == [48] * n
    n1, n2 = statistics.median(times[1]), statistics.median(times[2])
    print(f"n=1 median {n1:.3f}s {[round(t, 3) for t in times[1]]}; "
          f"n=2 median {n2:.3f}s {[round(t, 3) for t in times[2]]}")
    assert n2 < 3 * n1 + 1.0, (times[1], times[2])


def server_loads(url: str) -> list[dict]:
    return httpx.get(url + "/v1/loads?include=core,disagg", timeout=10,
                     trust_env=False).json()["loads"]


def busy(cluster: SglangCluster, since: float = 0.0) -> list[str]:
    """What is still running or queued: per server (its /v1/loads, every DP rank) and in the
    gateway (/admin/servers, from loopback: admin without a key). `/v1/loads` is a snapshot the
    scheduler refreshes about once a second when idle, seconds late when busy: one taken
    before `since` (wall clock) counts as busy."""
    found = []
    for url in [*cluster.prefill_urls, *cluster.decode_urls]:
        for load in server_loads(url):
            queues = {k: v for k, v in (load.get("disaggregation") or {}).items()
                      if k.endswith("_queue_reqs") and v}
            if load["num_running_reqs"] or load["num_waiting_reqs"] or queues:
                found.append(f"{url} rank {load['dp_rank']}: running {load['num_running_reqs']}"
                             f" waiting {load['num_waiting_reqs']} {queues}")
            elif load["timestamp"] < since:
                found.append(f"{url} rank {load['dp_rank']}: no snapshot since the wait began")
    listed = httpx.get(cluster.gateway + "/admin/servers", timeout=10, trust_env=False)
    assert listed.status_code == 200, listed.text
    for server in listed.json()["servers"]:
        in_flight = [server["in_flight"]] + [r["in_flight"] for r in server["ranks"]]
        if any(in_flight):
            found.append(f"gateway: {server['url']} in flight {in_flight}")
    return found


def wait_idle(cluster: SglangCluster, timeout: float = IDLE_WAIT) -> float:
    """Seconds until nothing is busy; fails with what is still busy after `timeout`."""
    start, since = time.monotonic(), time.time()
    while True:
        left = busy(cluster, since)
        if not left:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"still busy after {timeout:g}s: {left}")
        time.sleep(0.25)


def decodes_running(cluster: SglangCluster) -> int:
    return sum(load["num_running_reqs"] for url in cluster.decode_urls
               for load in server_loads(url))


def test_concurrent_n2_requests_leave_every_server_idle(sglang_cluster: SglangCluster) -> None:
    gw = sglang_cluster.gateway
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": N,
            "max_tokens": 16, "temperature": 0.7}
    bodies = [
        ("/generate", {"text": TEXTS, "sampling_params": {"n": N, "max_new_tokens": 16}}),
        ("/generate", {"input_ids": TOKENS[0], "stream": True,
                       "sampling_params": {"n": 3, "max_new_tokens": 16}}),
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/completions", {"model": MODEL, "prompt": TEXTS, "n": N, "max_tokens": 16,
                             "stream": True, "echo": True, "logprobs": 1}),
    ] * 2

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            return await asyncio.gather(*(client.post(gw + path, json=body)
                                          for path, body in bodies))

    for response in asyncio.run(run()):
        assert response.status_code == 200, response.text
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.count("data: [DONE]") == 1
    print(f"idle {wait_idle(sglang_cluster):.2f}s after the burst")


def test_client_leaving_an_n2_stream_stops_every_sample(sglang_cluster: SglangCluster) -> None:
    """The client reads a long n=2 stream until both samples run on the decodes, then hangs
    up: each sample's legs are stopped, so no decode keeps generating the ~1500 tokens nobody
    reads (the whole stream takes ~90 s here)."""
    body = {"text": TEXTS[0], "stream": True,
            "sampling_params": {"n": N, "max_new_tokens": 1500, "ignore_eos": True}}
    running, deadline = 0, time.monotonic() + 20
    with httpx.Client(timeout=60, trust_env=False) as client, \
            client.stream("POST", sglang_cluster.gateway + "/generate", json=body) as response:
        assert response.status_code == 200
        checked = 0.0
        for line in response.iter_lines():  # keep reading: a stalled client is cut off
            assert "[DONE]" not in line and time.monotonic() < deadline, running
            if time.monotonic() - checked > 0.3:
                running, checked = decodes_running(sglang_cluster), time.monotonic()
                if running == N:
                    break
    assert running == N
    print(f"idle {wait_idle(sglang_cluster):.2f}s after the client hung up")


def test_the_old_naive_n2_pd_body_fails_on_real_sglang(sglang_cluster: SglangCluster) -> None:
    """What the gateway used to send for n=2: the same body, with a room per expanded item, to
    both legs. SGLang sends a warm-up and both samples with the first room; the decode never
    answers (its own wait is 300 s). The connections are then closed, which aborts the
    request on both servers (SGLang aborts on client disconnect), and everything is idle."""
    wait_idle(sglang_cluster)
    body = sglang_cluster.pd_body({"text": TEXTS[1], "sampling_params": {
        "n": N, "max_new_tokens": 8, "temperature": 0.8}})
    body["bootstrap_room"] = [body["bootstrap_room"] + i for i in range(N)]

    async def legs() -> dict[str, Any]:
        results: dict[str, Any] = {}
        async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
            async def leg(name: str, url: str) -> None:
                response = await client.post(url + "/generate", json=body)
                results[name] = (response.status_code, response.text)

            tasks = [asyncio.create_task(leg("prefill", sglang_cluster.prefill_urls[0])),
                     asyncio.create_task(leg("decode", sglang_cluster.decode_urls[0]))]
            await asyncio.wait(tasks, timeout=20)
            results["busy while waiting"] = busy(sglang_cluster)
            for task in tasks:
                task.cancel()  # closes the connection
            await asyncio.gather(*tasks, return_exceptions=True)
        closed = time.time()
        await asyncio.sleep(1.5)
        results["busy 1.5 s after closing"] = busy(sglang_cluster, closed)
        return results

    results = asyncio.run(legs())
    print("naive n=2 PD body:", {k: v if k.startswith("busy") else (v[0], v[1][:200])
                                 for k, v in results.items()})
    decode = results.get("decode")
    if decode is not None and decode[0] == 200:
        try:
            items = json.loads(decode[1])
        except ValueError:
            items = None
        assert not (isinstance(items, list) and len(items) == N), f"it worked: {decode}"
    assert results["busy while waiting"], "the decode was not even waiting"
    print(f"idle {wait_idle(sglang_cluster):.2f}s after closing the naive request's connections")
