"""Pre-dispatch context check: prompts that cannot fit get a 400 naming the numbers, before
either leg is sent; text prompts near the limit are counted by a server's /v1/tokenize."""

import asyncio

import pytest

from backends.tiny_tokenizer import train, write_model
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
