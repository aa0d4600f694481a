"""LangChain (`langchain-openai`), the third client family users name, through the gateway to
simulated servers: what its chat and completion models send (its own defaults: `n`,
`stream_options`, `logprobs`, tools, the Responses API) must come back as a plain server's
answer, parsed by LangChain without a complaint."""

from __future__ import annotations

import asyncio

import httpx
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI, OpenAI
from pydantic import BaseModel

MODEL = "sim-model"


def chat(cluster, **options) -> ChatOpenAI:
    return ChatOpenAI(base_url=cluster.gateway + "/v1", api_key="unused", model=MODEL,
                      max_retries=0, timeout=30, temperature=0, **options)


def plain_chat(cluster, messages: list[dict], max_tokens: int) -> dict:
    return httpx.post(cluster.null + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0}).json()


def test_invoke_stream_and_batch_equal_a_plain_server(fresh):
    llm = chat(fresh, max_tokens=8)
    messages = [SystemMessage("be brief"), HumanMessage("hi there")]
    want = plain_chat(fresh, [{"role": "system", "content": "be brief"},
                              {"role": "user", "content": "hi there"}], 8)
    text = want["choices"][0]["message"]["content"]
    answer = llm.invoke(messages)
    assert answer.content == text and text
    assert answer.response_metadata["finish_reason"] == want["choices"][0]["finish_reason"]
    assert answer.usage_metadata["output_tokens"] == want["usage"]["completion_tokens"]
    chunks = list(llm.stream(messages))
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == text
    prompts = ["alpha", "beta", "gamma"]
    answers = llm.batch(prompts)  # LangChain's thread pool: concurrent requests
    for prompt, got in zip(prompts, answers, strict=True):
        ref = plain_chat(fresh, [{"role": "user", "content": prompt}], 8)
        assert got.content == ref["choices"][0]["message"]["content"]


def test_streamed_usage_when_asked(fresh):
    """`stream_usage=True` sends `stream_options.include_usage`: the gateway's usage chunk
    is what LangChain adds up into `usage_metadata`."""
    total = None
    for chunk in chat(fresh, max_tokens=6, stream_usage=True).stream("count to three"):
        total = chunk if total is None else total + chunk
    want = plain_chat(fresh, [{"role": "user", "content": "count to three"}], 6)
    assert total.content == want["choices"][0]["message"]["content"]
    assert total.usage_metadata["input_tokens"] == want["usage"]["prompt_tokens"]
    assert total.usage_metadata["output_tokens"] == want["usage"]["completion_tokens"]


def test_async_invoke_and_stream_side_by_side(fresh):
    llm = chat(fresh, max_tokens=5)

    async def go():
        async def streamed(prompt: str) -> str:
            return "".join([c.content async for c in llm.astream(prompt)])

        return await asyncio.gather(*(llm.ainvoke(f"question {i}") for i in range(6)),
                                    *(streamed(f"stream {i}") for i in range(4)))

    results = asyncio.run(go())
    for i, got in enumerate(results[:6]):
        ref = plain_chat(fresh, [{"role": "user", "content": f"question {i}"}], 5)
        assert got.content == ref["choices"][0]["message"]["content"]
    for i, text in enumerate(results[6:]):
        ref = plain_chat(fresh, [{"role": "user", "content": f"stream {i}"}], 5)
        assert text == ref["choices"][0]["message"]["content"]


def test_n2_generations_and_logprobs(fresh):
    """`n=2` (served as two PD requests, merged) gives LangChain two generations; logprobs
    come back where LangChain reads them."""
    result = chat(fresh, max_tokens=4, n=2).generate([[HumanMessage("pick a word")]])
    want = plain_chat(fresh, [{"role": "user", "content": "pick a word"}], 4)
    texts = [g.text for g in result.generations[0]]
    assert texts == [want["choices"][0]["message"]["content"]] * 2
    answer = chat(fresh, max_tokens=3, logprobs=True, top_logprobs=2).invoke("hello")
    content = answer.response_metadata["logprobs"]["content"]
    assert len(content) == 3 and all(len(t["top_logprobs"]) == 2 for t in content)


class Weather(BaseModel):
    city: str


def test_tools_and_structured_output_requests_are_served(fresh):
    """A model bound to tools sends `tools` and `tool_choice`; LangChain's function-calling
    structured output forces one. The simulator answers text, never a call, so LangChain
    parses no call: the gateway's part is that the request is forwarded and answered."""
    answer = chat(fresh, max_tokens=6).bind_tools([Weather]).invoke("weather in Paris?")
    assert answer.tool_calls == [] and answer.content
    assert chat(fresh, max_tokens=6).with_structured_output(
        Weather, method="function_calling").invoke("Paris") is None


def test_completion_model_and_the_responses_api(fresh):
    llm = OpenAI(base_url=fresh.gateway + "/v1", api_key="unused", model=MODEL, max_tokens=6,
                 temperature=0, max_retries=0, timeout=30)
    want = httpx.post(fresh.null + "/v1/completions", timeout=30, json={
        "prompt": "once upon a time", "max_tokens": 6, "temperature": 0}).json()
    assert llm.invoke("once upon a time") == want["choices"][0]["text"]
    assert "".join(llm.stream("once upon a time")) == want["choices"][0]["text"]
    responses = chat(fresh, max_tokens=6, use_responses_api=True)
    answer = responses.invoke("hi")
    assert answer.text and answer.usage_metadata["output_tokens"] == 6
    chunks = list(responses.stream("hi"))
    assert "".join(c.text for c in chunks) == answer.text
