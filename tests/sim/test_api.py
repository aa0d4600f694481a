"""JSON and SSE shapes of the native and OpenAI endpoints on a plain sim."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.sim.simproc import Sim

pytestmark = pytest.mark.timeout(60)


def sse_events(text: str) -> list[str]:
    events = [chunk[len("data: "):] for chunk in text.split("\n\n") if chunk.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    return events


def decoded(text: str) -> list[dict[str, Any]]:
    return [json.loads(e) for e in sse_events(text)[:-1]]


def test_generate_single(null_sim: Sim):
    r = null_sim.post("/generate", json={"text": "hello there", "rid": "r-single",
                                         "sampling_params": {"max_new_tokens": 5}})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "r-single"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 5
    assert {"cached_tokens", "e2e_latency"} <= set(meta)
    assert len(out["output_ids"]) == 5 and len(out["text"]) == 20


def test_generate_default_max_new_tokens_is_16(null_sim: Sim):
    r = null_sim.post("/generate", json={"text": "defaults"})
    assert r.json()["meta_info"]["completion_tokens"] == 16


def test_generate_input_ids_and_batch(null_sim: Sim):
    r = null_sim.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]],
                                         "sampling_params": {"max_new_tokens": 2}})
    out = r.json()
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 2]


def test_generate_stream_cumulative_text_and_done(null_sim: Sim):
    r = null_sim.post("/generate", json={"text": "stream me", "stream": True,
                                         "sampling_params": {"max_new_tokens": 4}})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = decoded(r.text)
    assert len(chunks) == 4
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(3))  # cumulative, not deltas
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 3
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_generate_stop_string(null_sim: Sim):
    full = null_sim.post("/generate", json={"text": "stop test", "sampling_params":
                                            {"max_new_tokens": 6}}).json()["text"]
    word = full[8:12]  # the third generated word
    r = null_sim.post("/generate", json={"text": "stop test", "sampling_params":
                                         {"max_new_tokens": 6, "stop": [word]}}).json()
    assert r["text"] == full[:8]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}


def test_generate_logprobs(null_sim: Sim):
    r = null_sim.post("/generate", json={"text": "log probs please", "return_logprob": True,
                                         "logprob_start_len": 0, "top_logprobs_num": 2,
                                         "sampling_params": {"max_new_tokens": 3}}).json()
    meta = r["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None
    assert [t[1] for t in meta["output_token_logprobs"]] == r["output_ids"]
    assert all(t[2] is None for t in meta["output_token_logprobs"])
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_bad_input_is_400(null_sim: Sim):
    r = null_sim.post("/generate", json={"sampling_params": {}})
    assert r.status_code == 400 and "error" in r.json()


def test_completions_shapes(null_sim: Sim):
    r = null_sim.post("/v1/completions", json={"model": "m", "prompt": ["one", "two"], "n": 2,
                                               "max_tokens": 3, "logprobs": 1, "echo": True})
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "m"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["choices"][0]["text"].startswith("one")
    assert out["choices"][2]["text"].startswith("two")
    assert out["choices"][0]["finish_reason"] == "length"
    lp = out["choices"][0]["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    usage = out["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == 2  # each prompt counted once, not per sample
    assert usage["total_tokens"] == 14
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_completions_stream_with_usage(null_sim: Sim):
    r = null_sim.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True,
                                               "stream_options": {"include_usage": True}})
    chunks = decoded(r.text)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == \
        null_sim.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).json()["choices"][0]["text"]


def test_chat_shapes_and_stream(null_sim: Sim):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = null_sim.post("/v1/chat/completions", json={"model": "m", "messages": msgs,
                                                      "max_tokens": 4, "logprobs": True,
                                                      "top_logprobs": 2}).json()
    assert out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"]) == 16
    entry = choice["logprobs"]["content"][0]
    assert {"token", "bytes", "logprob", "top_logprobs"} <= set(entry)
    assert len(entry["top_logprobs"]) == 2
    r = null_sim.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 4,
                                                    "stream": True,
                                                    "stream_options": {"include_usage": True}})
    chunks = decoded(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == choice["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 4


def test_chat_n_choices(null_sim: Sim):
    out = null_sim.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                      "n": 3, "max_tokens": 2}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 6


def test_openai_errors(null_sim: Sim):
    r = null_sim.post("/v1/completions", json={"prompt": ""})
    assert r.status_code == 400
    assert r.json() == {"object": "error", "message": "Prompt cannot be empty",
                        "type": "BadRequestError", "param": None, "code": 400}


def test_info_endpoints(null_sim: Sim):
    assert null_sim.get("/health").status_code == 200
    assert null_sim.get("/health_generate").status_code == 200
    models = null_sim.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "sim-model"
    for path in ("/model_info", "/get_model_info"):
        info = null_sim.get(path).json()
        assert info["model_path"] == "sim-model" and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = null_sim.get(path).json()
        assert info["disaggregation_mode"] == "null"
        assert {"disaggregation_bootstrap_port", "disaggregation_transfer_backend", "page_size",
                "dp_size", "served_model_name", "internal_states", "version"} <= set(info)
        assert info["version"] == "0.5.23" and info["kv_events"] is None


def test_loads_and_metrics(null_sim: Sim):
    loads = null_sim.get("/v1/loads", params={"include": "core,disagg,queues"}).json()
    entry = loads["loads"][0]
    assert entry["dp_rank"] == 0
    assert {"num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "num_used_tokens",
            "max_total_num_tokens", "token_usage", "cache_hit_rate"} <= set(entry)
    assert entry["disaggregation"]["mode"] == "null" and "queues" in entry
    assert "memory" not in entry
    assert null_sim.get("/v1/loads", params={"include": "bogus"}).status_code == 400
    null_sim.post("/generate", json={"text": "count me", "sampling_params": {"max_new_tokens": 2}})
    text = null_sim.get("/metrics").text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:cached_tokens_total", "sglang:prompt_tokens_total",
                 "sglang:generation_tokens_total", "sglang:time_to_first_token_seconds_bucket"):
        assert name in text
    assert 'model_name="sim-model",engine_type="unified"' in text


def test_loads_count_prefill_steps_like_the_scheduler():
    """total_prefill_uncached_tokens / total_prefill_busy_us grow by each prefill step's
    extended tokens and its modelled time (Scheduler._record_step_counters), so a router
    can read the server's prefill speed from two snapshots."""
    # the H100 estimate's linear model: 5 ms a step + 0.05 ms a token (test_timing.py checks
    # the calibrated default's)
    sim = Sim("null", "--timing", "h100-8b-estimate", fast=False)
    try:
        def counters() -> tuple[int, int]:
            entry = sim.get("/v1/loads").json()["loads"][0]
            return entry["total_prefill_uncached_tokens"], entry["total_prefill_busy_us"]
        tokens0, busy0 = counters()
        text = " ".join(f"word{i}" for i in range(400))  # fresh text: nothing cached
        sim.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
        tokens1, busy1 = counters()
        prompt = tokens1 - tokens0
        assert prompt > 400
        steps = -(-prompt // 8192)  # chunked prefill: at least this many steps
        assert (busy1 - busy0) >= int((5.0 * steps + 0.05 * prompt) * 1000) - steps
        sim.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
        tokens2, _ = counters()
        assert tokens2 - tokens1 < prompt / 4  # the repeat is cached: little extended
    finally:
        sim.stop()
