"""A Responses prefill answer's prompt and cached tokens, whole or streamed, as the gateway
counts them (`gateway_cached_tokens_total`): SGLang's usage there is `input_tokens` (cached
ones included) with `input_tokens_details.cached_tokens` (`ResponsesResponse._serialize_usage`)."""

from __future__ import annotations

import orjson
import pytest

from gateway.observability.answer_tokens import completion_final, completion_total, prompt_usage

USAGE = {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 30, "cache_write_tokens": 0},
         "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
         "total_tokens": 57}


def event(kind: str, response: dict) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + orjson.dumps({"type": kind, "response": response}) + b"\n\n")


@pytest.mark.parametrize("body", [
    pytest.param(orjson.dumps({"object": "response", "usage": USAGE}), id="whole"),
    pytest.param(event("response.created", {"usage": None})
                 + event("response.completed", {"usage": USAGE}), id="stream"),
])
def test_prompt_and_cached_tokens(body):
    assert prompt_usage(body) == (50, 30)


def test_output_tokens_are_the_completion():
    whole = orjson.dumps({"object": "response", "usage": USAGE})
    assert completion_total(whole) == 7
    assert completion_final(event("response.completed", {"usage": USAGE})) == 7
