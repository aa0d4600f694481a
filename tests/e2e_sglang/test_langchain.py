"""LangChain (`langchain-openai`) through the gateway to real SGLang PD servers on CPU: its
chat model's invoke, stream (with the usage it asks for), n = 2 and async calls give what the
same calls give against a plain SGLang server."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

from tests.e2e_sglang.conftest import SglangCluster

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # the first test pays the start-up


def chat(url: str, model: str, **options) -> ChatOpenAI:
    return ChatOpenAI(base_url=url + "/v1", api_key="unused", model=model, max_retries=0,
                      timeout=120, temperature=0, max_tokens=10, **options)


def test_langchain_chat_equals_plain_server(sglang_cluster: SglangCluster) -> None:
    model = sglang_cluster.model_name
    gateway = chat(sglang_cluster.gateway, model, stream_usage=True)
    plain = chat(sglang_cluster.null_url, model, stream_usage=True)
    question = [HumanMessage("Say something.")]
    want = plain.invoke(question)
    got = gateway.invoke(question)
    assert got.content == want.content and got.content
    assert got.usage_metadata["input_tokens"] == want.usage_metadata["input_tokens"]
    assert got.usage_metadata["output_tokens"] == want.usage_metadata["output_tokens"]

    total = None
    for chunk in gateway.stream(question):
        total = chunk if total is None else total + chunk
    assert total.content == want.content
    assert total.usage_metadata["output_tokens"] == want.usage_metadata["output_tokens"]

    samples = chat(sglang_cluster.gateway, model, n=2).generate([question])
    assert [g.text for g in samples.generations[0]] == [want.content] * 2

    prompts = ["one", "two", "three"]

    async def both() -> tuple[list, list]:
        return (await asyncio.gather(*(gateway.ainvoke(p) for p in prompts)),
                await asyncio.gather(*(plain.ainvoke(p) for p in prompts)))

    got_all, want_all = asyncio.run(both())
    assert [m.content for m in got_all] == [m.content for m in want_all]
