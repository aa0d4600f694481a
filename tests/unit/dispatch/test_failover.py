"""Mid-stream failover: a decode that dies mid-stream is replaced, and the client's stream goes
on as one well-formed stream (native and OpenAI shapes), or ends with an error event where a
continuation is not possible."""

import json

import orjson
import pytest

from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_gateway as gateway

P1 = "http://127.0.0.1:30000"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"


def sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def native(text: str, ids: list[int], finish=None) -> bytes:
    return sse({"text": text, "output_ids": ids,
                "meta_info": {"id": "orig", "prompt_tokens": 3, "completion_tokens": len(ids),
                              "finish_reason": finish}})


def objects(body: str) -> list[dict]:
    events = [e for e in body.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]" and body.count("[DONE]") == 1, body
    return [json.loads(e[6:]) for e in events[:-1]]


def cluster(first: list[bytes], second: list[bytes]) -> FakeCluster:
    return FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", chunks=first),
                        D2: FakeServer("decode", chunks=second)})


def test_native_token_prompt_continues_with_prompt_plus_output_ids():
    dying = [native(" a", [11]), native(" a b", [11, 12]), b"<error>"]
    rest = [native(" c", [13]), native(" c d", [13, 14], {"type": "length"}), b"data: [DONE]\n\n"]
    fake = cluster(dying, rest)

    async def go():
        async with gateway(fake) as (client, gw):
            r = await client.post("/generate", json={
                "input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 4}})
            metrics = (await client.get("/metrics")).text
            return r, metrics

    r, metrics = run(go())
    events = objects(r.text)
    assert not any("error" in e for e in events)
    assert [e["text"] for e in events] == [" a", " a b", " a b c", " a b c d"]
    assert events[-1]["output_ids"] == [11, 12, 13, 14]
    assert events[-1]["meta_info"]["completion_tokens"] == 4
    assert events[-1]["meta_info"]["id"] == "orig" and events[-1]["meta_info"]["prompt_tokens"] == 3
    continuation = fake.servers[D2].received[0]
    assert continuation["input_ids"] == [1, 2, 3, 11, 12]
    assert continuation["sampling_params"]["max_new_tokens"] == 2
    assert continuation["bootstrap_room"] != fake.servers[D1].received[0]["bootstrap_room"]
    assert 'gateway_stream_failovers_total{endpoint="generate",outcome="continued"} 1.0' in metrics


def chat_chunk(delta, finish=None, cid="chat-1") -> bytes:
    return sse({"id": cid, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_chat_continues_the_final_assistant_message():
    dying = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "Hel"}),
             chat_chunk({"content": "lo"}), b"<error>"]
    rest = [chat_chunk({"role": "assistant", "content": ""}, cid="chat-2"),
            chat_chunk({"content": " world"}, cid="chat-2"),
            chat_chunk({}, "stop", cid="chat-2"), b"data: [DONE]\n\n"]
    fake = cluster(dying, rest)

    async def go():
        async with gateway(fake) as (client, _):
            return await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}],
                "stream": True, "max_tokens": 10})

    events = objects(run(go()).text)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == "Hello world"
    assert sum(1 for e in events if e["choices"][0]["delta"].get("role")) == 1
    assert {e["id"] for e in events} == {"chat-1"}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    body = fake.servers[D2].received[0]
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body["continue_final_message"] is True and body["max_tokens"] == 8


@pytest.mark.parametrize("request_body, flags", [
    ({"input_ids": [1, 2], "stream": True, "return_logprob": True}, ()),
    ({"input_ids": [1, 2], "stream": True}, ("--no-midstream-failover",)),
], ids=["logprobs-not-resumable", "failover-off"])
def test_without_failover_the_stream_ends_with_an_error_event(request_body, flags):
    dying = [native(" a", [11]), b"<error>"]
    fake = cluster(dying, [native(" x", [99]), b"data: [DONE]\n\n"])

    async def go():
        async with gateway(fake, *flags) as (client, _):
            return await client.post("/generate", json=request_body)

    events = objects(run(go()).text)
    assert "error" in events[-1] and events[0]["text"] == " a"
    assert not fake.servers[D2].received


def test_a_stream_that_had_finished_only_gets_its_done():
    dying = [native(" a", [11]), native(" a b", [11, 12], {"type": "stop"}), b"<error>"]
    fake = cluster(dying, [])

    async def go():
        async with gateway(fake) as (client, _):
            return await client.post("/generate", json={"input_ids": [1], "stream": True})

    events = objects(run(go()).text)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop"}
    assert not fake.servers[D2].received


def test_partial_events_are_never_relayed_before_their_end():
    split = native(" a b", [11, 12])
    dying = [native(" a", [11]), split[:10], b"<error>"]
    rest = [native(" b", [12], {"type": "length"}), b"data: [DONE]\n\n"]
    fake = cluster(dying, rest)

    async def go():
        async with gateway(fake) as (client, _):
            return await client.post("/generate", json={"input_ids": [1], "stream": True})

    events = objects(run(go()).text)  # parses: no torn event reached the client
    assert [e["text"] for e in events] == [" a", " a b"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_cut_after_its_last_token_gets_its_finish_and_usage(include_usage):
    """The budget is spent (2 tokens) when the decode dies: nothing to continue, but the
    client still gets the finish SGLang would have sent, the usage it asked for, [DONE]."""
    dying = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": " a"}),
             chat_chunk({"content": " b"}), b"<error>"]
    fake = cluster(dying, [])
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}

    async def go():
        async with gateway(fake) as (client, _):
            return await client.post("/v1/chat/completions", json=body)

    events = objects(run(go()).text)
    assert not any("error" in e for e in events)
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert all(e["id"] == "chat-1" for e in events)
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage == ([{"prompt_tokens": usage[0]["prompt_tokens"], "completion_tokens": 2,
                       "total_tokens": usage[0]["prompt_tokens"] + 2}] if include_usage else [])
    assert not fake.servers[D2].received


def test_a_native_stream_cut_after_its_budget_gets_its_length_finish():
    dying = [native(" a", [11]), native(" a b", [11, 12]), b"<error>"]
    fake = cluster(dying, [])

    async def go():
        async with gateway(fake) as (client, _):
            return await client.post("/generate", json={
                "input_ids": [1], "stream": True, "sampling_params": {"max_new_tokens": 2}})

    events = objects(run(go()).text)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert events[-1]["text"] == " a b" and events[-1]["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("path, body, key, left", [
    ("/generate", {"input_ids": [1, 2, 3], "stream": True}, "max_new_tokens", 126),
    ("/generate", {"text": "hi", "stream": True, "sampling_params": {"temperature": 0}},
     "max_new_tokens", 126),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}, "max_tokens", 14),
])
def test_a_request_without_a_budget_continues_with_what_is_left_of_the_servers_default(
        path, body, key, left):
    """No budget named: SGLang's default (128 for /generate, 16 for completions) is the
    budget. Before, the continuation named none either, and its server granted the whole
    default again: 25 tokens for a completions request owed 16."""
    if path == "/generate":
        dying = [native(" a", [11]), native(" a b", [11, 12]), b"<error>"]
        rest = [native(" c", [13], {"type": "length", "length": left}), b"data: [DONE]\n\n"]
    else:
        dying = [sse({"id": "c1", "choices": [{"index": 0, "text": t, "finish_reason": None}]})
                 for t in (" a", " b")] + [b"<error>"]
        rest = [sse({"id": "c2", "choices": [{"index": 0, "text": " c",
                                              "finish_reason": "length"}]}), b"data: [DONE]\n\n"]
    fake = cluster(dying, rest)

    async def go():
        async with gateway(fake) as (client, _):
            return await client.post(path, json=body)

    events = objects(run(go()).text)
    continuation = fake.servers[D2].received[0]
    budget = (continuation.get("sampling_params") or {}) if path == "/generate" else continuation
    assert budget[key] == left
    if path == "/generate":  # the budget the client's request had, not the continuation's
        assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


def test_a_continuations_cached_count_stays_within_the_original_prompt():
    """The continuation's server counts its cached prefix over the prompt plus the text
    generated before the break: relayed as it was, a continued stream reported more cached
    tokens than prompt tokens (prompt 1, cached 2; 2026-12-07)."""
    dying = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "a"}),
             chat_chunk({"content": "b"}), b"<error>"]
    usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 6}}
    rest = [chat_chunk({"content": "c"}, cid="chat-2"), chat_chunk({}, "stop", cid="chat-2"),
            sse({"id": "chat-2", "object": "chat.completion.chunk", "choices": [],
                 "usage": usage}), b"data: [DONE]\n\n"]
    fake = cluster(dying, rest)

    async def go():
        async with gateway(fake) as (client, _):
            return await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 10, "stream_options": {"include_usage": True}})

    final = objects(run(go()).text)[-1]["usage"]
    assert final["prompt_tokens"] == 5 and final["completion_tokens"] == 3
    assert final["prompt_tokens_details"]["cached_tokens"] == 5


def test_a_native_continuations_cached_count_stays_within_the_original_prompt():
    dying = [native(" a", [11]), native(" a b", [11, 12]), b"<error>"]
    meta = {"id": "next", "prompt_tokens": 5, "completion_tokens": 1, "cached_tokens": 5,
            "finish_reason": {"type": "length", "length": 1}}
    rest = [sse({"text": " c", "output_ids": [13], "meta_info": meta}), b"data: [DONE]\n\n"]
    fake = cluster(dying, rest)

    async def go():
        async with gateway(fake) as (client, _):
            return await client.post("/generate", json={
                "input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 3}})

    last = objects(run(go()).text)[-1]["meta_info"]
    assert last["prompt_tokens"] == 3 and last["cached_tokens"] == 3
