"""Parallel sampling (n > 1): fanned out into n single-sample PD requests, merged back.

The scripted servers answer like SGLang does for one sample; the gateway must send each
sample with n = 1 and its own room, put the later samples on the first sample's prefill, and
merge the answers in SGLang's order and shape (prompt-major, choices[].index, usage).
"""

import asyncio
import itertools
import json

import orjson
import pytest

from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_client as gateway

P1, P2 = "http://127.0.0.1:30000", "http://127.0.0.1:30002"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"


def numbered_decode(endpoint: str, counter=None):
    """A decode whose answers say which request (in arrival order) they answer."""
    counter = counter if counter is not None else itertools.count()

    def body(request: dict) -> dict:
        k = next(counter)
        if endpoint == "generate":
            items = request.get("text")
            if isinstance(items, list):
                return [{"text": f"{t}#{k}", "meta_info": {"id": request["rid"][i],
                         "prompt_tokens": 3, "completion_tokens": 2}}
                        for i, t in enumerate(items)]
            return {"text": f"{items}#{k}", "meta_info": {"id": request["rid"],
                    "prompt_tokens": 3, "completion_tokens": 2}}
        if endpoint == "chat":
            return {"id": f"chat-{k}", "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant",
                                                          "content": f"answer {k}"},
                                 "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                              "prompt_tokens_details": {"cached_tokens": 1}}}
        prompts = request["prompt"] if isinstance(request["prompt"], list) else [request["prompt"]]
        return {"id": f"cmpl-{k}", "object": "text_completion",
                "choices": [{"index": i, "text": f"{p}#{k}", "finish_reason": "length"}
                            for i, p in enumerate(prompts)],
                "usage": {"prompt_tokens": 2 * len(prompts), "completion_tokens": 3 * len(prompts),
                          "total_tokens": 5 * len(prompts)}}

    return body


def two_by_two(endpoint: str, **decode) -> FakeCluster:
    counter = itertools.count()  # shared: every answer of the cluster has its own number
    return FakeCluster({
        P1: FakeServer("prefill"), P2: FakeServer("prefill"),
        D1: FakeServer("decode", body=numbered_decode(endpoint, counter), **decode),
        D2: FakeServer("decode", body=numbered_decode(endpoint, counter), **decode),
    })


def legs(cluster: FakeCluster, role: str) -> list[dict]:
    return [b for s in cluster.servers.values() if s.role == role for b in s.received]


def test_native_single_prompt_n3_is_three_single_sample_requests_on_one_prefill():
    cluster = two_by_two("generate")

    async def go():
        async with gateway(cluster) as client:
            return await client.post("/generate", json={
                "text": "hi", "sampling_params": {"n": 3, "temperature": 0.7}})

    r = run(go())
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 3
    decodes = legs(cluster, "decode")
    assert len(decodes) == 3
    assert all(b["sampling_params"]["n"] == 1 for b in decodes)
    assert all(b["sampling_params"]["temperature"] == 0.7 for b in decodes)
    rooms = [b["bootstrap_room"] for b in decodes]
    assert all(isinstance(room, int) for room in rooms) and len(set(rooms)) == 3
    assert len({b["rid"] for b in decodes}) == 3
    used = {url for url, s in cluster.servers.items() if s.role == "prefill" and s.received}
    assert len(used) == 1, "samples must share the first sample's prefill (cached prompt)"
    assert [item["meta_info"]["id"] for item in out] != [None] * 3


def test_native_batch_times_n_is_prompt_major():
    cluster = two_by_two("generate")

    async def go():
        async with gateway(cluster) as client:
            return await client.post("/generate", json={
                "text": ["a", "b"], "sampling_params": {"n": 2}})

    out = run(go()).json()
    assert [item["text"].split("#")[0] for item in out] == ["a", "a", "b", "b"]
    # items 0 and 1 are two different samples of prompt "a"
    assert out[0]["text"] != out[1]["text"]
    decodes = legs(cluster, "decode")
    assert len(decodes) == 2 and all(len(b["bootstrap_room"]) == 2 for b in decodes)


def test_chat_n2_choices_and_usage():
    cluster = two_by_two("chat")

    async def go():
        async with gateway(cluster) as client:
            return await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2})

    body = run(go()).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"]["content"] != body["choices"][1]["message"]["content"]
    assert body["usage"]["prompt_tokens"] == 5  # once per prompt, as SGLang counts it
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == 13
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    assert all(b["n"] == 1 for b in legs(cluster, "decode"))


def test_completions_list_prompt_n2_indexes_prompt_major():
    cluster = two_by_two("completions")

    async def go():
        async with gateway(cluster) as client:
            return await client.post("/v1/completions", json={
                "model": "m", "prompt": ["x", "y"], "n": 2, "max_tokens": 3})

    body = run(go()).json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"].split("#")[0] for c in choices] == ["x", "x", "y", "y"]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 12


def chat_chunks() -> list[bytes]:
    def chunk(delta, finish=None):
        return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk",
                                         "choices": [{"index": 0, "delta": delta,
                                                      "finish_reason": finish}]}) + b"\n\n"
    usage = {"id": "c", "object": "chat.completion.chunk", "choices": [],
             "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}
    return [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
            chunk({"content": "lo"}, "length"), b"data: " + orjson.dumps(usage) + b"\n\n",
            b"data: [DONE]\n\n"]


def test_chat_stream_n2_interleaves_by_index_with_one_done_and_merged_usage():
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=chat_chunks())})

    async def go():
        async with gateway(cluster) as client:
            return await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                "stream": True, "stream_options": {"include_usage": True}})

    r = run(go())
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]" and r.text.count("[DONE]") == 1
    objects = [json.loads(e[6:]) for e in events[:-1]]
    by_index: dict[int, str] = {}
    for obj in objects[:-1]:
        for choice in obj["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + \
                (choice["delta"].get("content") or "")
    assert by_index == {0: "Hello", 1: "Hello"}
    usage = objects[-1]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 5
    assert usage["usage"]["completion_tokens"] == 4 and usage["usage"]["total_tokens"] == 9


def test_one_failing_sample_fails_the_request_and_stops_the_others():
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", body=numbered_decode("generate")),
                           D2: FakeServer("decode", status=400)})

    async def go():
        async with gateway(cluster, "--max-attempts", "1") as client:
            r = await client.post("/generate", json={"text": "hi", "sampling_params": {"n": 4}})
            await asyncio.sleep(0.05)
            return r

    r = run(go())
    assert r.status_code == 400  # a sample's client error is the request's
    assert "decode server" in r.json()["error"]["message"]


def test_later_samples_start_after_the_first_prefill_answered():
    answered: list[float] = []

    def prefill_body(body):
        answered.append(asyncio.get_running_loop().time())
        return {"text": "", "meta_info": {"prompt_tokens": 3, "cached_tokens": 0}}

    cluster = FakeCluster({P1: FakeServer("prefill", body=prefill_body, delay=0.1),
                           D1: FakeServer("decode", body=numbered_decode("generate"),
                                          delay=0.3)})

    async def go():
        async with gateway(cluster) as client:
            return await client.post("/generate", json={"text": "hi", "sampling_params": {"n": 3}})

    assert run(go()).status_code == 200
    arrivals = cluster.servers[P1].arrivals
    assert len(arrivals) == 3
    # sample 0 alone first; samples 1 and 2 only once its prefill has answered (cached prompt)
    assert arrivals[1] >= answered[0] and arrivals[2] >= answered[0]
    assert arrivals[1] - arrivals[0] >= 0.09


@pytest.mark.parametrize("n", [1, 2])
def test_items_limit_counts_batch_times_n(n):
    cluster = two_by_two("generate")

    async def go():
        async with gateway(cluster, "--max-items", "3") as client:
            return await client.post("/generate", json={"text": ["a", "b"],
                                                        "sampling_params": {"n": n}})

    r = run(go())
    assert r.status_code == (200 if n == 1 else 400)


def identified_chunks(ident: str, created: int) -> list[bytes]:
    """A chat stream whose chunks name their own stream, as each sample's server does."""
    return [b"data: " + orjson.dumps({**obj, "id": ident, "created": created,
                                      "model": f"model-{ident}"}) + b"\n\n"
            if chunk.startswith(b"data: {") and (obj := orjson.loads(chunk[6:])) else chunk
            for chunk in chat_chunks()]


@pytest.mark.parametrize("usage", [True, False], ids=["with usage chunk", "without"])
def test_stream_n2_has_one_id_created_and_model(usage):
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=identified_chunks("one", 1)),
                           D2: FakeServer("decode", chunks=identified_chunks("two", 2))})

    async def go():
        async with gateway(cluster) as client:
            return await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                "stream": True, "stream_options": {"include_usage": usage}})

    r = run(go())
    assert r.status_code == 200
    assert len(legs(cluster, "decode")) == 2 and all(  # both servers named their stream
        s.received for s in cluster.servers.values())
    events = [e for e in r.text.split("\n\n") if e.strip() and e != "data: [DONE]"]
    objects = [json.loads(e[6:]) for e in events]
    assert {(o["id"], o["created"], o["model"]) for o in objects} in (
        {("one", 1, "model-one")}, {("two", 2, "model-two")}), objects
    assert {c["index"] for o in objects for c in o["choices"]} == {0, 1}


def test_a_sample_with_a_cut_off_body_is_a_502_not_a_500():
    """A decode that answered 200 with half a JSON body: the merge must not raise
    JSONDecodeError (the gateway's 500 "internal gateway error")."""
    from gateway.dispatch.parallel_samples import Samples
    from gateway.dispatch.pd import Answer
    from gateway.errors import UpstreamError
    from gateway.request import parse_request

    whole = orjson.dumps({"id": "a", "choices": [{"index": 0, "text": "x"}]})
    bodies = iter([whole, whole[: len(whole) // 2]])

    class Proxy:
        async def handle(self, view, tracked, placement=None):
            return Answer(200, b"application/json", next(bodies))

    view = parse_request("completions", orjson.dumps({"prompt": "hi", "n": 2}))
    with pytest.raises(UpstreamError) as info:
        run(Samples(Proxy()).handle(view, None))
    assert info.value.status == 502 and info.value.leg == "decode"
    assert "sample 1 of 2" in info.value.message


@pytest.mark.parametrize("flags", [(), ("--no-midstream-failover",)], ids=["failover", "off"])
def test_a_samples_failure_after_its_head_is_continued_or_written_in_the_gateways_shape(flags):
    """A sample's decode reports a failure after its first event (SGLang's error event, a
    number as `code`): the sample goes on on the other decode; without mid-stream failover the
    merge ends the sample with the gateway's error event (`code` a string, like every gateway
    error), and the other sample is whole."""
    broken = [chat_chunks()[0], b'data: {"error": {"message": "decode failed", '
              b'"type": "InternalServerError", "code": 500}}\n\n', b"data: [DONE]\n\n"]
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=chat_chunks()),
                           D2: FakeServer("decode", chunks=broken)})

    async def go():
        async with gateway(cluster, *flags) as client:
            return await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                "stream": True})

    r = run(go())
    assert r.status_code == 200 and r.text.count("[DONE]") == 1
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    finished = {c["index"] for e in events for c in e.get("choices", []) if c["finish_reason"]}
    if not flags:
        assert errors == [] and finished == {0, 1}, r.text
        return
    assert len(errors) == 1 and "decode failed" in errors[0]["message"], r.text
    assert isinstance(errors[0]["code"], str) and len(finished) == 1


class ScriptedSamples:
    """A proxy whose k-th `handle` call (sample k) runs `script[k]`, and which records
    which samples' answers were closed and which calls were cancelled."""

    def __init__(self, *script) -> None:
        self.script = script
        self.calls = 0
        self.closed: list[int] = []
        self.cancelled: list[int] = []

    async def handle(self, view, tracked, placement=None):
        from gateway.dispatch.pd import Answer

        k = self.calls
        self.calls += 1
        try:
            chunks = await self.script[k]()
        except asyncio.CancelledError:
            self.cancelled.append(k)
            raise

        async def stream():
            for chunk in chunks:
                yield chunk

        async def close() -> None:
            self.closed.append(k)

        return Answer(200, b"text/event-stream", stream=stream(), close=close)


def stream_view(n: int = 2):
    from gateway.request import parse_request

    return parse_request("chat", orjson.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n,
        "stream": True}))


def test_a_merged_stream_starts_at_the_first_samples_first_chunk():
    """The client gets sample 0's events while sample 1 has no answer yet (its decode still
    queued): one server's n > 1 stream is not held back for its slowest sample."""
    from gateway.dispatch.parallel_samples import Samples

    release = asyncio.Event()

    async def fast():
        return chat_chunks()

    async def slow():
        await release.wait()
        return chat_chunks()

    proxy = ScriptedSamples(fast, slow)

    async def go():
        answer = await Samples(proxy).handle(stream_view(), None)
        events = answer.stream.__aiter__()
        first = orjson.loads((await events.__anext__())[6:])
        release.set()
        rest = b"".join([chunk async for chunk in events])
        await answer.close()
        return first, rest

    first, rest = run(go(), timeout=5)
    assert first["choices"][0]["index"] == 0 and first["choices"][0]["delta"]["role"]
    assert b'"index":1' in rest and rest.endswith(b"data: [DONE]\n\n")
    assert rest.count(b"[DONE]") == 1
    assert sorted(proxy.closed) == [0, 1]


def test_a_sample_failing_after_the_stream_started_ends_it_with_an_error_event():
    """Sample 1 spends its retries after sample 0 began streaming: an error event in the
    gateway's shape, one [DONE], and sample 0's legs closed."""
    from gateway.dispatch.parallel_samples import Samples
    from gateway.errors import UpstreamError

    started = asyncio.Event()

    async def streaming():
        return [chat_chunks()[0]]

    async def failing():
        await started.wait()
        raise UpstreamError("decode server failed", leg="decode", server_url=D1,
                            retryable=False, reason="status")

    proxy = ScriptedSamples(streaming, failing)

    async def go():
        answer = await Samples(proxy).handle(stream_view(), None)
        events = answer.stream.__aiter__()
        first = await events.__anext__()
        started.set()
        rest = b"".join([chunk async for chunk in events])
        await answer.close()
        return first, rest

    first, rest = run(go(), timeout=5)
    assert b'"index":0' in first
    errors = [orjson.loads(e[6:])["error"] for e in rest.split(b"\n\n")
              if e.startswith(b"data: {")]
    assert len(errors) == 1 and "decode server failed" in errors[0]["message"], rest
    assert isinstance(errors[0]["code"], str)
    assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"[DONE]") == 1
    assert proxy.closed == [0]


def test_a_sample_failing_before_any_answer_fails_the_stream_cleanly():
    """Nothing was sent yet: the failure is the request's error answer, and the sample
    still waiting is cancelled."""
    from gateway.dispatch.parallel_samples import Samples
    from gateway.errors import UpstreamError

    async def waiting():
        await asyncio.Event().wait()

    async def failing():
        raise UpstreamError("decode server failed", leg="decode", server_url=D1,
                            retryable=False, reason="status")

    proxy = ScriptedSamples(waiting, failing)
    with pytest.raises(UpstreamError):
        run(Samples(proxy).handle(stream_view(), None), timeout=5)
    assert proxy.cancelled == [0]


def test_closing_a_merged_stream_nobody_reads_returns_and_closes_every_answer():
    """The client stopped reading: the queue is full and both pumps wait to put. `close`
    must stop them and close both samples' legs (a pump that put its end marker on the way
    out waited for good, and the request with it)."""
    from gateway.dispatch.parallel_samples import QUEUE_DEPTH, Samples

    async def endless():
        return chat_chunks()[:1] * 1000

    proxy = ScriptedSamples(endless, endless)

    async def go():
        answer = await Samples(proxy).handle(stream_view(), None)
        events = answer.stream.__aiter__()
        await events.__anext__()
        for _ in range(10 * QUEUE_DEPTH):  # the pumps run until the queue is full
            await asyncio.sleep(0)
        await asyncio.wait_for(answer.close(), 2)

    run(go(), timeout=5)
    assert sorted(proxy.closed) == [0, 1]
