"""The request view: batch detection like SGLang, routing keys, and 400s for bad input."""

import orjson
import pytest

from gateway.errors import BadRequest
from gateway.request import CHAT, COMPLETIONS, GENERATE, parse_request


def view(endpoint, body):
    return parse_request(endpoint, orjson.dumps(body))


@pytest.mark.parametrize(
    "endpoint, body, batch, n, rooms",
    [
        (GENERATE, {"text": "hi"}, None, 1, None),
        (GENERATE, {"text": ["a", "b", "c"]}, 3, 1, 3),
        (GENERATE, {"input_ids": [1, 2, 3]}, None, 1, None),
        (GENERATE, {"input_ids": [[1, 2], [3]]}, 2, 1, 2),
        (GENERATE, {"text": "hi", "sampling_params": {"n": 4}}, None, 4, 4),
        (GENERATE, {"text": ["a", "b"], "sampling_params": {"n": 2}}, 2, 2, 4),
        (COMPLETIONS, {"prompt": "hi"}, None, 1, None),
        (COMPLETIONS, {"prompt": ["a", "b"]}, 2, 1, 2),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, None, 1, None),
        (COMPLETIONS, {"prompt": [[1, 2], [3, 4]]}, 2, 1, 2),
        (COMPLETIONS, {"prompt": "hi", "n": 3}, None, 3, 3),
        (CHAT, {"messages": [{"role": "user", "content": "x"}]}, None, 1, None),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 2}, None, 2, 2),
    ],
    ids=["text", "text-list", "ids", "ids-2d", "n4", "batch-n2", "prompt", "prompt-list",
         "prompt-ids", "prompt-ids-2d", "prompt-n3", "chat", "chat-n2"],
)
def test_batch_detection(endpoint, body, batch, n, rooms):
    v = view(endpoint, body)
    assert (v.batch_size, v.n, v.room_count) == (batch, n, rooms)


def test_chat_routing_key_covers_all_messages():
    system = {"role": "system", "content": "You are helpful."}
    a = view(CHAT, {"messages": [system, {"role": "user", "content": "tell me about cats"}]})
    b = view(CHAT, {"messages": [system, {"role": "user", "content": "tell me about dogs"}]})
    assert a.routing_text != b.routing_text
    assert a.routing_text.startswith(b.routing_text[:20])
    assert "cats" in a.routing_text


def test_chat_content_parts_render_text():
    v = view(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]})
    assert "abc" in v.routing_text


def test_token_routing_key():
    v = view(GENERATE, {"input_ids": [5, 6, 7]})
    assert v.routing_key == (5, 6, 7)


def test_logprob_merge_flags():
    assert view(GENERATE, {"text": "x", "return_logprob": True}).logprob_merge
    assert not view(GENERATE, {"text": "x"}).logprob_merge
    assert view(GENERATE, {"text": ["x", "y"], "return_logprob": [False, True]}).logprob_merge
    assert not view(GENERATE, {"text": ["x", "y"], "return_logprob": [False, False]}) \
        .logprob_merge
    assert view(COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 1}).logprob_merge
    assert not view(COMPLETIONS, {"prompt": "x", "logprobs": 1}).logprob_merge


@pytest.mark.parametrize(
    "endpoint, raw, message",
    [
        (GENERATE, b"", "empty"),
        (GENERATE, b"{not json", "not valid JSON"),
        (GENERATE, b"[1,2]", "JSON object"),
        (GENERATE, b'{"sampling_params": {}}', "text"),
        (GENERATE, b'{"text": 5}', "'text'"),
        (GENERATE, b'{"text": []}', "'text'"),
        (GENERATE, b'{"input_ids": ["a"]}', "'input_ids'"),
        (GENERATE, b'{"text": "x", "stream": "yes"}', "'stream'"),
        (GENERATE, b'{"text": "x", "sampling_params": 3}', "sampling_params"),
        (GENERATE, b'{"text": "x", "sampling_params": {"n": 0}}', "sampling_params.n"),
        (GENERATE, b'{"text": "x", "bootstrap_room": 5}', "assigned by the gateway"),
        (GENERATE, b'{"text": ["a", "b"], "sampling_params": [{"n": 3}, {"n": 1}]}',
         "same 'n'"),
        (GENERATE, b'{"text": ["a", "b"], "sampling_params": [{}, {"n": 2}]}', "same 'n'"),
        (GENERATE, b'{"text": "a", "return_logprob": [true]}', "return_logprob"),
        (GENERATE, b'{"text": ["a", "b"], "return_logprob": [true]}', "return_logprob"),
        (GENERATE, b'{"text": ["a", "b"], "return_logprob": [true, false], '
                   b'"sampling_params": {"n": 2}}', "return_logprob"),
        (CHAT, b'{"messages": []}', "'messages'"),
        (CHAT, b'{"messages": [{"content": "x"}]}', "role"),
        (CHAT, b'{"messages": [{"role": "user", "content": 5}]}', "content"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "n": "two"}', "'n'"),
        (COMPLETIONS, b'{"prompt": 5}', "'prompt'"),
        (COMPLETIONS, b'{"prompt": "x", "logprobs": "1.5"}', "'logprobs'"),
        (COMPLETIONS, b'{"prompt": "x", "model": 1}', "'model'"),
    ],
    ids=["empty", "bad-json", "not-object", "no-text", "text-int", "text-empty", "ids-str",
         "stream-str", "params-int", "n-zero", "client-room", "mixed-n", "mixed-n-default",
         "logprob-list-single", "logprob-list-short", "logprob-list-n2",
         "no-messages", "no-role",
         "content-int", "n-str", "prompt-int", "logprobs-str", "model-int"],
)
def test_bad_input(endpoint, raw, message):
    with pytest.raises(BadRequest, match=message):
        parse_request(endpoint, raw)
