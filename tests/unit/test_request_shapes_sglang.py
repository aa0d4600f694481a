"""Request shapes SGLang 0.5.23 serves that the gateway misread: a single prompt with a one-item
`sampling_params` list, chat `input_ids` as the prompt, and the OpenAI endpoints' lax
(pydantic) reading of `n`, `stream`, `echo`, `logprobs`."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import BadRequest
from gateway.request import CHAT, COMPLETIONS, GENERATE, RequestView, parse_request
from tests.unit.fakes import FakeCluster, FakeServer, run, served_client

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
HI = [{"role": "user", "content": "hi"}]


def view(endpoint: str, body: dict) -> RequestView:
    return parse_request(endpoint, orjson.dumps(body))


def single_with_list(body: dict) -> bool:
    """What SGLang 500s on: a single prompt with a `sampling_params` LIST
    (`TokenizerManager._validate_one_request` calls `.get` on it)."""
    ids = body.get("input_ids")
    single = isinstance(body.get("text"), str) or (isinstance(ids, list) and ids
                                                   and isinstance(ids[0], int))
    return bool(single) and isinstance(body.get("sampling_params"), list)


def cluster(**info) -> FakeCluster:
    return FakeCluster({P1: FakeServer("prefill", fail_if=single_with_list, info=info),
                        D1: FakeServer("decode", fail_if=single_with_list, info=info)})


async def post(fake: FakeCluster, path: str, body: dict):
    async with served_client(fake) as client:
        return await client.post(path, json=body)


# -- 1: a single prompt's one-item sampling_params list --------------------------------------

@pytest.mark.parametrize("prompt", [{"text": "a"}, {"input_ids": [1, 2, 3]}], ids=["text", "ids"])
def test_single_prompt_params_list_with_n_is_served_as_sglang_does(prompt):
    """SGLang's `_handle_parallel_sampling` makes it a batch of one: n answers, as a list."""
    body = {**prompt, "sampling_params": [{"n": 2, "max_new_tokens": 3}]}
    v = view(GENERATE, body)
    assert (v.batch_size, v.n, v.room_count) == (None, 2, 2)
    assert v.body["sampling_params"] == {"n": 2, "max_new_tokens": 3}
    fake = cluster()
    answer = run(post(fake, "/generate", body))
    assert answer.status_code == 200, answer.text
    assert isinstance(answer.json(), list) and len(answer.json()) == 2
    legs = [b for s in fake.servers.values() for b in s.received]
    assert legs and all(b["sampling_params"] == {"n": 1, "max_new_tokens": 3} for b in legs)


@pytest.mark.parametrize("params", [[{}], [{"n": 1, "max_new_tokens": 3}]], ids=["empty", "n1"])
def test_single_prompt_params_list_without_n_is_a_400_naming_the_field(params):
    """SGLang keeps the prompt single and fails on the list (a 500): refused, never forwarded."""
    with pytest.raises(BadRequest, match="'sampling_params'"):
        view(GENERATE, {"text": "a", "sampling_params": params})
    fake = cluster()
    answer = run(post(fake, "/generate", {"text": "a", "sampling_params": params}))
    assert answer.status_code == 400 and "sampling_params" in answer.text
    assert not any(s.received for s in fake.servers.values())


# -- 2: chat input_ids are the prompt ---------------------------------------------------------

def test_chat_input_ids_are_the_routing_tokens_and_the_exact_count():
    """serving_chat.py uses `request.input_ids` as the prompt and skips the template."""
    ids = list(range(500))
    v = view(CHAT, {"messages": HI, "input_ids": ids})
    assert (v.routing_tokens, v.prompt_tokens, v.lengths) == (tuple(ids), 500, (500,))
    assert v.routing_key == tuple(ids)
    plain = view(CHAT, {"messages": HI, "input_ids": []})  # not token ids: the messages count
    assert plain.lengths is None and plain.routing_tokens is None and plain.routing_text


def test_chat_input_ids_over_the_context_are_refused_like_generate():
    fake = cluster(context_length=100)
    for path, body in (("/generate", {"input_ids": list(range(500))}),
                       ("/v1/chat/completions", {"model": "fake", "messages": HI,
                                                 "input_ids": list(range(500))})):
        answer = run(post(fake, path, body))
        assert answer.status_code == 400 and "context_length_exceeded" in answer.text, path
    assert not any(s.received for s in fake.servers.values())
    assert not any(s.tokenized for s in fake.servers.values())


# -- 3: the OpenAI endpoints read n, stream, echo, logprobs as pydantic's lax mode does ----------
# (values from TypeAdapter(bool | int).validate_python in SGLang 0.5.23's venv, pydantic 2.14.4)

TRUE = [True, 1, 1.0, "true", "True", "TRUE", "1", "yes", "on", "t", "y"]
FALSE = [False, 0, 0.0, "false", "0", "no", "off", "f", "n"]
NOT_BOOL = [2, -1, 2.5, " true", "2", "", "maybe", [], {}]


@pytest.mark.parametrize("endpoint, base", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "x"})])
def test_stream_is_read_as_pydantic_reads_a_bool(endpoint, base):
    for value in TRUE:
        assert view(endpoint, {**base, "stream": value}).stream is True, value
    for value in FALSE:
        assert view(endpoint, {**base, "stream": value}).stream is False, value
    for value in NOT_BOOL:
        with pytest.raises(BadRequest, match="'stream'"):
            view(endpoint, {**base, "stream": value})
    with pytest.raises(BadRequest, match="'stream'"):  # /generate's contract stays strict
        view(GENERATE, {"text": "x", "stream": "true"})


@pytest.mark.parametrize("endpoint, base", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "x"})])
def test_n_is_read_as_pydantic_reads_an_int(endpoint, base):
    for value, n in (("2", 2), (2.0, 2), (" 3 ", 3), ("+2", 2), ("2.0", 2), (True, 1), ("1", 1)):
        v = view(endpoint, {**base, "n": value})
        assert (v.n, v.room_count) == (n, n if n > 1 else None), value
    for value in ("two", 2.5, "2.5", "", "0x2", "1e2", [], 0, "0", False):
        with pytest.raises(BadRequest, match="'n'"):
            view(endpoint, {**base, "n": value})


def test_completions_echo_and_logprobs_are_read_as_pydantic_does():
    """`logprobs: Optional[int]` takes true/false/"2"/2.0; `echo: bool` takes "false"."""
    for logprobs in (True, False, "2", 2.0, "0", 0.0):
        assert view(COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": logprobs}) \
            .logprob_merge, logprobs
    for echo, merge in (("false", False), ("true", True), (0, False), ("on", True)):
        assert view(COMPLETIONS, {"prompt": "x", "echo": echo, "logprobs": 1}) \
            .logprob_merge is merge, echo
    for logprobs in ("1.5", 2.5, "two", []):
        with pytest.raises(BadRequest, match="'logprobs'"):
            view(COMPLETIONS, {"prompt": "x", "logprobs": logprobs})
    with pytest.raises(BadRequest, match="'echo'"):
        view(COMPLETIONS, {"prompt": "x", "echo": "maybe"})


def test_lax_n_and_stream_reach_the_split_through_the_gateway():
    """`"n": "2"` was a 400; SGLang serves two choices, so the gateway splits it in two."""
    def answer(body: dict) -> dict:
        return {"id": "c", "object": "text_completion", "model": "fake",
                "choices": [{"index": 0, "text": "t", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    fake = FakeCluster({P1: FakeServer("prefill", body=answer),
                        D1: FakeServer("decode", body=answer)})
    reply = run(post(fake, "/v1/completions", {"model": "fake", "prompt": "x", "n": "2",
                                               "stream": "false"}))
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == [0, 1]
    assert all(b["n"] == 1 for b in fake.servers[D1].received)
