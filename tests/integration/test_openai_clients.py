"""Real clients (the official openai SDK, raw HTTP) through the gateway to simulated servers."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.gateway + "/v1", api_key="unused", max_retries=0,
                         timeout=30)


def direct_null(cluster, path: str, body: dict) -> dict:
    return httpx.post(cluster.null + path, json=body, timeout=30).json()


def test_chat_sync_matches_a_plain_server(fresh):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    got = client(fresh).chat.completions.create(model="sim-model", messages=messages,
                                                max_tokens=8)
    want = direct_null(fresh, "/v1/chat/completions",
                       {"model": "sim-model", "messages": messages, "max_tokens": 8})
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert got.choices[0].message.content
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"]


def test_completions_sync_and_batch(fresh):
    c = client(fresh)
    one = c.completions.create(model="sim-model", prompt="once upon a time", max_tokens=6)
    want = direct_null(fresh, "/v1/completions",
                       {"model": "sim-model", "prompt": "once upon a time", "max_tokens": 6})
    assert one.choices[0].text == want["choices"][0]["text"]
    many = c.completions.create(model="sim-model", prompt=["alpha", "beta", "gamma"], max_tokens=4)
    assert len(many.choices) == 3
    texts = {ch.index: ch.text for ch in many.choices}
    for i, prompt in enumerate(["alpha", "beta", "gamma"]):
        ref = direct_null(fresh, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
        assert texts[i] == ref["choices"][0]["text"]


def test_chat_streaming_sync(fresh):
    messages = [{"role": "user", "content": "stream me something"}]
    stream = client(fresh).chat.completions.create(
        model="sim-model", messages=messages, max_tokens=10, stream=True,
        stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    want = direct_null(fresh, "/v1/chat/completions", {"messages": messages, "max_tokens": 10})
    assert "".join(pieces) == want["choices"][0]["message"]["content"]
    assert len(pieces) > 1
    assert usage is not None and usage.completion_tokens == want["usage"]["completion_tokens"]


def test_async_client_concurrent_and_streaming(fresh):
    async def go():
        c = openai.AsyncOpenAI(base_url=fresh.gateway + "/v1", api_key="x", max_retries=0,
                               timeout=30)
        prompts = [f"question number {i}" for i in range(12)]
        answers = await asyncio.gather(*(
            c.completions.create(model="sim-model", prompt=p, max_tokens=5) for p in prompts))
        stream = await c.completions.create(model="sim-model", prompt="streamed", max_tokens=5,
                                            stream=True)
        text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        await c.close()
        return prompts, answers, text

    prompts, answers, text = asyncio.run(go())
    for prompt, answer in zip(prompts, answers, strict=True):
        ref = direct_null(fresh, "/v1/completions", {"prompt": prompt, "max_tokens": 5})
        assert answer.choices[0].text == ref["choices"][0]["text"]
    ref = direct_null(fresh, "/v1/completions", {"prompt": "streamed", "max_tokens": 5})
    assert text == ref["choices"][0]["text"]


def test_models_endpoint_via_sdk(fresh):
    models = client(fresh).models.list()
    assert [m.id for m in models.data]


def test_sdk_sees_openai_error_for_bad_request(fresh):
    with pytest.raises(openai.BadRequestError) as info:
        client(fresh).chat.completions.create(model="sim-model", messages=[])
    assert "messages" in str(info.value)


def test_completions_echo_logprobs_include_prompt_from_prefill(fresh):
    body = {"prompt": "the quick brown fox", "max_tokens": 3, "echo": True, "logprobs": 1}
    got = httpx.post(fresh.gateway + "/v1/completions", json=body, timeout=30).json()
    want = direct_null(fresh, "/v1/completions", body)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
    stream = httpx.post(fresh.gateway + "/v1/completions", json={**body, "stream": True},
                        timeout=30).text
    ref = httpx.post(fresh.null + "/v1/completions", json={**body, "stream": True},
                     timeout=30).text

    def logprob_tokens(sse: str) -> list:
        import json

        tokens = []
        for event in sse.split("\n\n"):
            if event.startswith("data: {"):
                for choice in json.loads(event[6:]).get("choices", []):
                    tokens += (choice.get("logprobs") or {}).get("tokens", [])
        return tokens

    assert logprob_tokens(stream) == logprob_tokens(ref)
    assert len(logprob_tokens(stream)) > 3
