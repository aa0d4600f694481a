"""Parallel sampling (n > 1) through the gateway, against real SGLang 0.5.23 PD servers on CPU.

SGLang cannot serve n > 1 in PD mode (one room for n + 1 requests, docs/FIDELITY.md); the
gateway sends n single-sample PD requests and merges them (gateway/dispatch/parallel_samples.py). Every answer
here is compared with what the plain (`--disaggregation-mode null`) server answers to the same
request: greedy samples are equal, so texts, order (prompt-major: item `i*n + j` is sample j of
prompt i), indices and usage (prompt tokens once per prompt) must match exactly.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e_sglang.conftest import SglangCluster
from tests.e2e_sglang.sampling import MODEL, TEXTS, TOKENS, N, stream, whole

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # the first test pays the start-up

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
    for key in ("output_top_logprobs", "input_top_logprobs"):  # the prompt's: the prefill's
        if key in ref:
            assert len(meta[key]) == len(ref[key]), key


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
