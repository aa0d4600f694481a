"""Pre-dispatch context check: prompts that cannot fit get a 400 naming the numbers, before
either leg is sent; text prompts near the limit are counted by a server's /v1/tokenize."""

import asyncio
import json

import pytest

from backends.tiny_tokenizer import train, write_model
from gateway.request import RESPONSES
from gateway.responses.view import parse_responses
from gateway.tokens.context_check import most_tokens
from gateway.tokens.tokenizer import load_tokenizer
from tests.unit.fakes import FakeCluster, FakeServer
from tests.unit.fakes import served_client as gateway

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
CONTEXT = 100


def cluster() -> FakeCluster:
    info = {"context_length": CONTEXT}
    return FakeCluster({P1: FakeServer("prefill", info=info),
                        D1: FakeServer("decode", info=info)})


@pytest.mark.parametrize("path, body, status, words", [
    ("/generate", {"input_ids": list(range(100))}, 400, ["100 tokens", "100 tokens"]),
    ("/generate", {"input_ids": list(range(90)), "sampling_params": {"max_new_tokens": 20}},
     400, ["90 tokens", "20 new tokens", "100"]),
    ("/generate", {"input_ids": list(range(90)), "sampling_params": {"max_new_tokens": 10}},
     200, []),
    ("/generate", {"input_ids": [[1] * 10, [2] * 120]}, 400, ["120 tokens"]),
    ("/v1/completions", {"prompt": list(range(99)), "max_tokens": 5}, 400, ["99 tokens"]),
    ("/generate", {"text": "short prompt"}, 200, []),
    ("/generate", {"text": "x" * 260}, 400, ["130 tokens"]),  # counted by /v1/tokenize: 130
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 300}]}, 400,
     ["tokens"]),
], ids=["ids-at-context", "ids-plus-budget-over", "ids-plus-budget-fits", "batch-item-over",
        "completions-token-prompt", "short-text-no-count", "long-text-counted",
        "long-chat-counted"])
def test_context_check(path, body, status, words):
    fake = cluster()

    async def go():
        async with gateway(fake) as client:
            return await client.post(path, json={"model": "fake", **body})

    r = asyncio.run(asyncio.wait_for(go(), 20))
    assert r.status_code == status, r.text
    if status == 400:
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert all(w in error["message"] for w in words), error["message"]
        assert not fake.servers[D1].received and not fake.servers[P1].received


@pytest.mark.parametrize("decode_bound, prompt, status", [
    (80, 79, 200), (80, 80, 400), (None, 94, 400), (None, 93, 200)])
def test_the_servers_input_bound_is_tighter_than_the_context(decode_bound, prompt, status):
    """SGLang's scheduler refuses a prompt of `max_req_input_len` tokens or more
    (`validate_input_length`; the context or KV pool, less 6): 5 tokens short of the context
    it passed the context rule, went to both legs, and the prefill refused it. The least
    bound of either role's servers applies."""
    info = {"context_length": CONTEXT, "max_req_input_len": CONTEXT - 6}
    decode = {**info, "max_req_input_len": decode_bound} if decode_bound else info
    fake = FakeCluster({P1: FakeServer("prefill", info=info),
                        D1: FakeServer("decode", info=decode)})

    async def go():
        async with gateway(fake) as client:
            return await client.post("/generate", json={"input_ids": list(range(prompt))})

    r = asyncio.run(asyncio.wait_for(go(), 20))
    assert r.status_code == status, r.text
    if status == 400:
        message = r.json()["error"]["message"]
        bound = decode_bound or CONTEXT - 6
        assert f"fewer than {bound} tokens" in message and "max_req_input_len" in message
        assert not fake.servers[P1].received


def test_short_text_costs_no_tokenize_call():
    fake = cluster()

    async def go():
        async with gateway(fake) as client:
            for _ in range(5):
                assert (await client.post("/generate", json={"text": "hi"})).status_code == 200

    asyncio.run(asyncio.wait_for(go(), 20))
    assert fake.servers[D1].tokenized == 0


def test_with_the_models_tokenizer_a_long_prompt_is_counted_here(tmp_path):
    """Near the limit, the served model's tokenizer counts (no /v1/tokenize call); its count,
    not the server's (the fake's is characters / 2), is the one in the answer."""
    model = write_model(tmp_path / "model", train())
    fake = cluster()
    text = "語" * 80  # ~240 tokens of this byte-level BPE, ~20 by the characters/4 estimate
    expected = len(load_tokenizer(model).encode_text(text))
    assert expected >= CONTEXT

    async def go():
        async with gateway(fake, "--tokenizer", str(model)) as client:
            near = await client.post("/generate", json={"text": text})
            short = await client.post("/generate", json={"text": "hi"})
            return near, short

    near, short = asyncio.run(asyncio.wait_for(go(), 20))
    assert short.status_code == 200  # far from the limit: not tokenized at all
    assert near.status_code == 400
    assert f"the prompt has {expected} tokens" in near.json()["error"]["message"]
    assert fake.servers[D1].tokenized == 0 and fake.servers[P1].tokenized == 0


def test_a_responses_turn_is_bounded_by_its_bytes_not_estimated():
    """Skipping the exact count needs an upper bound of the prompt's tokens. A Responses turn
    was bounded by its characters / 4: a tokenizer with short tokens (the CPU rig's tiny model
    splits " more" in 3) passed the context unchecked, and the prefill refused the turn
    (tests/e2e_sglang/test_context.py). It is bounded by its body's bytes, like a chat."""
    history = [{"role": "user", "content": "more " * 150},
               {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
               {"role": "user", "content": "more " * 150}]
    raw = json.dumps({"model": "m", "input": history}).encode()
    view = parse_responses(RESPONSES, raw)
    assert most_tokens(view) >= 2 * len("more " * 150)
