"""Parallel sampling (n > 1) as SGLang 0.5.23 runs it: a warm-up per prompt, then n samples
that share the prompt's bootstrap room; on a plain server that works, on a PD pair it fails."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from backends.sim.config import config_from_args
from backends.sim.requests import BadRequest, parse_generate
from tests.sim.simproc import Sim

pytestmark = pytest.mark.timeout(60)

PROMPT = "Parallel sampling, one prompt"


def _cfg():
    return config_from_args(["--fast"])


def sse_objects(text: str) -> list[Any]:
    events = [c[6:] for c in text.split("\n\n") if c.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- normalization (GenerateReqInput + TokenizerManager._handle_batch_request) ----

def test_n_makes_a_warmup_per_prompt_then_prompt_major_samples():
    parsed = parse_generate({"text": ["p0", "p1"], "rid": "req", "bootstrap_room": [40, 41],
                             "sampling_params": {"n": 3, "max_new_tokens": 5}}, _cfg())
    assert [w.max_new_tokens for w in parsed.warmups] == [0, 0]
    assert [w.stream for w in parsed.warmups] == [False, False]
    assert [w.text for w in parsed.warmups] == ["p0", "p1"]
    assert [(s.index, s.text, s.bootstrap_room) for s in parsed.items] == [
        (0, "p0", 40), (1, "p0", 40), (2, "p0", 40), (3, "p1", 41), (4, "p1", 41), (5, "p1", 41)]
    # a string rid expands to rid_i for batch * n entries; warm-ups and samples get new rids
    assert parsed.rids == [f"req_{i}" for i in range(6)]
    fresh = [w.rid for w in parsed.warmups] + [s.rid for s in parsed.items]
    assert len(set(fresh)) == 8 and not any(r.startswith("req") for r in fresh)


def test_single_prompt_with_n_becomes_a_batch_and_keeps_its_room():
    parsed = parse_generate({"text": PROMPT, "bootstrap_room": 7, "sampling_params": {"n": 2}},
                            _cfg())
    assert not parsed.is_single
    assert [w.bootstrap_room for w in parsed.warmups] == [7]
    assert [s.bootstrap_room for s in parsed.items] == [7, 7]  # room + i is only for obj[i]


@pytest.mark.parametrize("body, message", [
    ({"text": ["a", "b"], "rid": ["x", "y", "z", "w"], "sampling_params": {"n": 2}},
     "The specified rids length mismatch with the batch_size for batch processing."),
    ({"text": ["a", "b"], "rid": ["x", "x"]},
     "Duplicate request IDs detected within the request: ['x']"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]},
     "The parallel_sample_num should be the same for all samples in sample params."),
    ({"text": "a", "sampling_params": {"n": 2}, "top_logprobs_num": [1]},
     "Cannot use list top_logprobs_num with parallel_sample_num > 1"),
])
def test_sglang_refusals(body, message):
    with pytest.raises(BadRequest, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        parse_generate(body, _cfg())


# ---- a plain server: n > 1 works ----

def test_native_n_answers_prompt_major_after_a_cached_warmup(null_sim: Sim):
    prompt_ids = list(range(900, 930))
    r = null_sim.post("/generate", json={"input_ids": [prompt_ids, prompt_ids[:20]],
                                         "sampling_params": {"n": 2, "max_new_tokens": 3}})
    assert r.status_code == 200
    out = r.json()
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [30, 30, 20, 20]
    # the warm-up prefilled each prompt first: every sample hits the cache
    assert [o["meta_info"]["cached_tokens"] for o in out] == [29, 29, 19, 19]
    assert all("index" not in o for o in out)  # only stream chunks carry index
    assert len({o["meta_info"]["id"] for o in out}) == 4
    # greedy (no temperature): the samples of a prompt are equal
    assert out[0]["text"] == out[1]["text"] and out[2]["text"] == out[3]["text"]
    stats = null_sim.stats()
    assert stats["requests"]["/generate"] >= 1


def test_native_n_stream_chunks_carry_their_position(null_sim: Sim):
    r = null_sim.post("/generate", json={"text": ["first one", "second one"], "stream": True,
                                         "sampling_params": {"n": 2, "max_new_tokens": 2}})
    chunks = sse_objects(r.text)
    by_index: dict[int, list[dict[str, Any]]] = {}
    for c in chunks:
        by_index.setdefault(c["index"], []).append(c)
    assert sorted(by_index) == [0, 1, 2, 3]
    ids = {i: {c["meta_info"]["id"] for c in cs} for i, cs in by_index.items()}
    assert all(len(v) == 1 for v in ids.values())  # one rid per index
    prompts = {i: cs[-1]["meta_info"]["prompt_tokens"] for i, cs in by_index.items()}
    assert prompts[0] == prompts[1] == 3 and prompts[2] == prompts[3] == 3
    assert all(cs[-1]["meta_info"]["finish_reason"]["length"] == 2 for cs in by_index.values())


def test_openai_n_choices_and_usage_count_the_prompt_once(null_sim: Sim):
    r = null_sim.post("/v1/completions", json={"model": "m", "prompt": ["alpha beta", "gamma"],
                                               "n": 3, "max_tokens": 2})
    out = r.json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    usage = out["usage"]
    # calculate_response_usage: prompt and cached tokens of every n-th choice only
    assert usage["prompt_tokens"] == 3 + 2 and usage["completion_tokens"] == 12
    assert usage["prompt_tokens_details"]["cached_tokens"] == 2 + 1
    chat = null_sim.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True}})
    objs = sse_objects(chat.text)
    assert {c["choices"][0]["index"] for c in objs if c["choices"]} == {0, 1}
    final = objs[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    prompt = final["usage"]["prompt_tokens"]
    assert 0 < prompt == null_sim.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
    }).json()["usage"]["prompt_tokens"]


def test_samples_differ_with_temperature_and_agree_without(null_sim: Sim):
    def texts(**sampling: Any) -> list[str]:
        r = null_sim.post("/generate", json={"text": PROMPT, "sampling_params": {
            "n": 4, "max_new_tokens": 6, **sampling}})
        return [o["text"] for o in r.json()]
    assert len(set(texts(temperature=0.8))) == 4
    assert len(set(texts(temperature=0))) == 1
    assert len(set(texts())) == 1  # an absent temperature is greedy in the sim
    assert len(set(texts(temperature=0.8, top_k=1))) == 1
    seeded = texts(temperature=0.8, sampling_seed=42)
    assert len(set(seeded)) == 1 and seeded == texts(temperature=0.8, sampling_seed=42)
    assert seeded != texts(temperature=0.8, sampling_seed=43)


# ---- a PD pair: the naive n > 1 request fails, n single requests work ----

async def _pair(prefill: Sim, decode: Sim, payloads: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=20) as client:
        tasks = []
        for payload in payloads:
            tasks.append(client.post(prefill.url + "/generate", json=payload))
            tasks.append(client.post(decode.url + "/generate", json=payload))
        return list(await asyncio.gather(*tasks))


@pytest.mark.parametrize("rooms", ["list", "scalar"])
def test_naive_n_request_fails_on_a_pd_pair(pd_pair, room, rooms):
    """The old gateway's body: n = 2 with rooms for batch * n items (or one scalar room)."""
    prefill, decode = pd_pair
    numbers = [room(), room()]
    value: Any = numbers if rooms == "list" else numbers[0]
    payload = {"text": PROMPT, "sampling_params": {"n": 2, "max_new_tokens": 4},
               **prefill.pd_fields(value)}
    start = time.monotonic()
    p, d = asyncio.run(_pair(prefill, decode, [payload]))
    elapsed = time.monotonic() - start
    assert p.status_code == 500 and d.status_code == 500
    assert "Duplicate or cancelled bootstrap room" in p.json()["message"]
    assert f"bootstrap_room={numbers[0]}" in d.json()["message"]
    assert elapsed < 5  # bounded by the lowered timeouts, not SGLang's hang
    # the warm-ups paired and used the room; its samples reused it; the second room is unused
    rows = [x for x in prefill.stats()["rooms"] if x["room"] in numbers]
    assert [x["outcome"] for x in rows if x["room"] == numbers[0]].count("completed") == 1
    assert all(x["room"] == numbers[0] for x in rows)
    assert prefill.room_state(numbers[1]) == "unknown"


def test_naive_n_decode_sample_waits_out_the_timeout(pd_pair, room):
    """A decode sample that joins the warm-up's room never gets KV: it times out."""
    prefill, decode = pd_pair
    number = room()
    payload = {"text": PROMPT, "sampling_params": {"n": 2, "max_new_tokens": 4},
               **prefill.pd_fields(number)}
    asyncio.run(_pair(prefill, decode, [payload]))

    def timed_out() -> list[dict[str, Any]]:
        return [x for x in decode.stats()["rooms"]
                if x["room"] == number and "KVPoll.WaitingForInput" in (x["reason"] or "")]
    deadline = time.monotonic() + 5
    while not timed_out() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(timed_out()) == 1


def test_n_single_sample_requests_with_own_rooms_succeed(pd_pair, null_sim, room):
    prefill, decode = pd_pair
    payloads = [{"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0.9},
                 "rid": f"sample-{i}-{number}", **prefill.pd_fields(number)}
                for i, number in enumerate([room(), room(), room()])]
    answers = asyncio.run(_pair(prefill, decode, payloads))
    assert all(a.status_code == 200 for a in answers)
    decode_texts = [a.json()["text"] for a in answers[1::2]]
    assert len(set(decode_texts)) == 3  # sampled: the prefill's rid picks each text
    greedy = [{**p, "sampling_params": {"max_new_tokens": 4}, "rid": p["rid"] + "-g",
               "bootstrap_room": room()} for p in payloads]
    answers = asyncio.run(_pair(prefill, decode, greedy))
    plain = null_sim.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 4}}).json()["text"]
    assert [a.json()["text"] for a in answers[1::2]] == [plain] * 3


def test_a_failed_warmup_fails_the_request(pd_pair, room):
    """The warm-up's HTTPException escapes generate_request: an error answer, or a broken stream."""
    prefill, _ = pd_pair
    payload = {"text": PROMPT, "sampling_params": {"n": 2}, **prefill.pd_fields(room())}
    r = prefill.post("/generate", json=payload)  # no decode: the warm-up times out
    assert r.status_code == 500 and "KVPoll.Bootstrapping" in r.json()["message"]
    with httpx.stream("POST", prefill.url + "/generate", timeout=10,
                      json={**payload, "stream": True, "bootstrap_room": room()}) as stream:
        assert stream.status_code == 200  # the head went out before the warm-up
        with pytest.raises(httpx.RemoteProtocolError):
            stream.read()
