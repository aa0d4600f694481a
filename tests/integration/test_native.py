"""SGLang's native /generate through the gateway: plain, streamed, batched, with logprobs."""

from __future__ import annotations

import httpx
import orjson
import pytest


def post(cluster, path, body, **kw):
    return httpx.post(cluster.gateway + path, json=body, timeout=30, **kw)


def null_generate(cluster, body):
    return httpx.post(cluster.null + "/generate", json=body, timeout=30).json()


def sse_objects(raw: bytes) -> list:
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]"
    return [orjson.loads(e[len(b"data: "):]) for e in events[:-1]]


def test_generate_text_matches_plain_server(fresh):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}
    r = post(fresh, "/generate", body)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == null_generate(fresh, body)["text"]
    assert r.headers["x-request-id"]


def test_generate_input_ids(fresh):
    body = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 5}}
    r = post(fresh, "/generate", body)
    assert r.status_code == 200
    assert r.json()["text"] == null_generate(fresh, body)["text"]


def test_generate_stream_relays_events(fresh):
    body = {"text": "stream please", "stream": True, "sampling_params": {"max_new_tokens": 6}}
    r = post(fresh, "/generate", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    objects = sse_objects(r.content)
    assert len(objects) >= 2
    assert objects[-1]["text"] == null_generate(fresh, {**body, "stream": False})["text"]


def test_generate_batch_text_and_ids(fresh):
    body = {"text": ["one", "two", "three"], "sampling_params": {"max_new_tokens": 4}}
    r = post(fresh, "/generate", body)
    assert r.status_code == 200, r.text
    items = r.json()
    assert [i["text"] for i in items] == [i["text"] for i in null_generate(fresh, body)]
    ids = {"input_ids": [[1, 2, 3], [4, 5, 6]], "sampling_params": {"max_new_tokens": 3}}
    r = post(fresh, "/generate", ids)
    assert r.status_code == 200 and len(r.json()) == 2


def test_logprobs_carry_prefill_prompt_part(fresh):
    body = {"text": "count the tokens here", "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 4}}
    r = post(fresh, "/generate", body)
    meta = r.json()["meta_info"]
    ref = null_generate(fresh, body)["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(ref["input_token_logprobs"]) > 0
    assert [t[1] for t in meta["input_token_logprobs"]] == [t[1] for t in ref["input_token_logprobs"]]
    assert len(meta["output_token_logprobs"]) == 4


def test_streamed_logprobs_carry_prefill_prompt_part(fresh):
    body = {"text": "count the tokens here", "return_logprob": True, "logprob_start_len": 0, "stream": True,
            "sampling_params": {"max_new_tokens": 4}}
    objects = sse_objects(post(fresh, "/generate", body).content)
    ref = null_generate(fresh, {**body, "stream": False})["meta_info"]
    for obj in objects:
        ids = [t[1] for t in obj["meta_info"]["input_token_logprobs"]]
        assert ids[: len(ref["input_token_logprobs"])] == [t[1] for t in ref["input_token_logprobs"]]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_top_logprobs_carry_the_prefill_part_too(fresh, stream):
    """With `top_logprobs_num`, each prompt token's top logprobs come from the prefill as
    well (`input_top_logprobs`): only `input_token_logprobs` was merged, so the two lists
    the client got were of different lengths."""
    body = {"text": "count the tokens here", "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 2, "stream": stream, "sampling_params": {"max_new_tokens": 4}}
    answer = post(fresh, "/generate", body)
    meta = (sse_objects(answer.content)[-1] if stream else answer.json())["meta_info"]
    ref = null_generate(fresh, {**body, "stream": False})["meta_info"]
    assert len(ref["input_top_logprobs"]) == len(ref["input_token_logprobs"]) > 0
    assert meta["input_top_logprobs"] == ref["input_top_logprobs"]
    assert len(meta["input_token_logprobs"]) == len(meta["input_top_logprobs"])


def test_each_request_used_new_rooms(fresh):
    for i in range(5):
        assert post(fresh, "/generate", {"text": f"r{i}"}).status_code == 200
    stats = fresh.stats(fresh.prefill[0][0])
    rooms = [r["room"] for r in stats["rooms"]]
    assert len(rooms) >= 5 and len(set(rooms)) == len(rooms)
