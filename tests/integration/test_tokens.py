"""Exact prompt tokens in the request path: the gateway finds the served model's tokenizer
from the servers' `/model_info` and counts chat prompts with it (gateway/tokens/prompt_tokens.py).

The prompts are CJK text: the tiny byte-level BPE has no merges for it, so each character
costs 3 tokens, while the characters/4 estimate (and the simulator's 4-bytes-per-token
tokenizer) sees far fewer. Each outcome below therefore happens only with exact counts."""

from __future__ import annotations

import httpx
import pytest

from backends.tiny_tokenizer import train, write_model
from gateway.prefix.tree import CHARS_PER_TOKEN
from gateway.tokens.tokenizer import load_tokenizer
from tests.integration.conftest import sim_cluster

KEY = {"authorization": "Bearer key-a"}
OTHER_KEY = {"authorization": "Bearer key-b"}  # its own prompt-token bucket
CONTEXT = 64
TOKENS_PER_MINUTE = 100


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("model") / "tiny-model", train())
    sims = ["--context-length", str(CONTEXT), "--model-path", str(model)]
    gateway = ["--api-key", "key-a", "--api-key", "key-b", "--rate-limit-tokens", str(TOKENS_PER_MINUTE)]
    tokenizer = load_tokenizer(model)
    with sim_cluster(tmp_path_factory.mktemp("logs"), n_decode=1, sim_args=sims,
                     gateway_args=gateway) as cluster:
        yield cluster, tokenizer
    tokenizer.close()


def chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], **extra}


def test_the_tokenizer_is_found_from_model_info(counted):
    cluster, _ = counted
    stats = httpx.get(cluster.gateway + "/admin/policies", timeout=10).json()["prompt_tokens"]
    assert stats["tokenizer"] is not None and "tiny-model" in stats["tokenizer"]


def test_a_chat_too_long_for_the_context_is_refused_with_its_exact_count(counted):
    cluster, tokenizer = counted
    body = chat("語" * 20, max_tokens=4)
    exact = len(tokenizer.encode_chat(body))
    assert TOKENS_PER_MINUTE > exact >= CONTEXT > len(str(body["messages"])) // 4
    answer = httpx.post(cluster.gateway + "/v1/chat/completions", json=body,
                        headers=OTHER_KEY, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"the prompt has {exact} tokens" in error["message"]


def test_the_prompt_token_limit_charges_exact_counts(counted):
    cluster, tokenizer = counted
    small = chat("hello world", max_tokens=2)
    assert len(tokenizer.encode_chat(small)) < CONTEXT
    answer = httpx.post(cluster.gateway + "/v1/chat/completions", json=small, headers=KEY,
                        timeout=30)
    assert answer.status_code == 200, answer.text
    large = chat("語" * 35, max_tokens=2)  # more than a minute's worth: refused at once
    exact = len(tokenizer.encode_chat(large))
    assert exact > TOKENS_PER_MINUTE
    answer = httpx.post(cluster.gateway + "/v1/chat/completions", json=large, headers=KEY,
                        timeout=30)
    assert answer.status_code == 429
    assert f"{exact} tokens exceed this API key's limit" in answer.json()["error"]["message"]


def test_text_prompts_are_routed_by_their_token_ids(counted):
    cluster, tokenizer = counted
    text = "the quick brown fox jumps"
    ids = tokenizer.encode_text(text)
    assert len(ids) != len(text)

    def tree_size() -> int:
        stats = httpx.get(cluster.gateway + "/admin/policies", timeout=10).json()
        return stats["prefill"]["stats"]["tree_size"]
    before = tree_size()
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
    answer = httpx.post(cluster.gateway + "/generate", json=body, headers=KEY, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["prompt_tokens"] > 0
    # the cache-aware tree holds its ids, not its text (a token is CHARS_PER_TOKEN size units)
    assert tree_size() - before == len(ids) * CHARS_PER_TOKEN
