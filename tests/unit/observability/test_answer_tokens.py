"""Completion tokens read from answers without parsing every streamed chunk."""

from __future__ import annotations

import orjson
import pytest

from gateway.observability.answer_tokens import (
    StreamTokens,
    completion_final,
    completion_total,
    leg_stream_options,
    usage_forced,
)
from gateway.request import parse_request
from gateway.sse import DONE, frame


def native(completion: int, text: str = "hi", finish: object = None, index=None) -> dict:
    out = {"text": text, "output_ids": [1, 2],
           "meta_info": {"id": "r", "finish_reason": finish, "prompt_tokens": 9,
                         "completion_tokens": completion, "cached_tokens": 4}}
    if index is not None:
        out["index"] = index
    return out


def chat_chunk(content: str) -> dict:
    return {"id": "c", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}


USAGE_CHUNK = {"id": "c", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}}
TRICKY = 'say "completion_tokens": 99 and "usage":{ please'  # as text, escaped in JSON


@pytest.mark.parametrize("body, expected", [
    (orjson.dumps(native(7)), 7),
    (orjson.dumps([native(3), native(4), native(5)]), 12),
    (orjson.dumps({"choices": [{"message": {"content": TRICKY}}],
                   "usage": {"prompt_tokens": 2, "completion_tokens": 6,
                             "completion_tokens_details": {"reasoning_tokens": 1}}}), 6),
    (b'{"usage": {"completion_tokens" : 11}}', 11),
    (orjson.dumps({"choices": [{"message": {"content": TRICKY}}]}), None),
    (b'{"error": {"message": "boom"}}', None),
], ids=["native", "native-batch-summed", "openai-text-holds-the-key", "spaces",
        "no-usage", "error"])
def test_completion_total(body, expected):
    assert completion_total(body) == expected


@pytest.mark.parametrize("tail, expected", [
    (frame(native(3)) + frame(native(4)) + DONE, 4),
    (frame(chat_chunk(TRICKY)) + frame(USAGE_CHUNK) + DONE, 5),
    (frame(chat_chunk("x")) + DONE, None),
    (b"", None),
], ids=["native-last-event", "openai-usage-event", "openai-without-usage", "empty"])
def test_completion_final(tail, expected):
    assert completion_final(tail) == expected


def view(endpoint: str, body: dict):
    return parse_request(endpoint, orjson.dumps(body))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True}


@pytest.mark.parametrize("endpoint, body, forced", [
    ("chat", CHAT, True),
    ("completions", {"model": "m", "prompt": "q", "stream": True}, True),
    ("chat", {**CHAT, "stream": False}, False),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, False),
    ("chat", {**CHAT, "stream_options": {"include_usage": "yes"}}, False),
    ("chat", {**CHAT, "stream_options": {"include_usage": False}}, True),
    ("chat", {**CHAT, "stream_options": {}}, True),
    ("chat", {**CHAT, "stream_options": {"continuous_usage_stats": True}}, True),
    ("generate", {"text": "q", "stream": True}, False),
], ids=["chat-stream", "completions-stream", "not-a-stream", "client-asked", "client-asked-lax",
        "client-declined", "empty-options", "continuous-only", "native"])
def test_usage_is_asked_for_wherever_the_client_did_not_ask(endpoint, body, forced):
    """A client that declined the usage event (or sent options without it) used to be left
    alone: its streamed tokens went uncounted (by tenant and key: metering)."""
    v = view(endpoint, body)
    assert usage_forced(v) is forced
    sent = leg_stream_options(v)
    if forced:
        kept = {k: v for k, v in (body.get("stream_options") or {}).items()
                if k != "continuous_usage_stats"}
        assert sent == {**kept, "include_usage": True}
    else:
        assert sent == body.get("stream_options")


def test_a_forced_usage_event_is_counted_and_kept_from_the_client():
    meter = StreamTokens.of(view("chat", CHAT))
    first = frame(chat_chunk(TRICKY))
    assert meter.feed(first) == first  # text that names the keys is no usage event
    last = frame(chat_chunk("!")) + frame(USAGE_CHUNK) + DONE
    assert meter.feed(last) == frame(chat_chunk("!")) + DONE
    assert meter.completion == 5
    assert meter.feed(frame(USAGE_CHUNK)) == b""  # alone in its chunk: nothing left to send


def test_continuous_usage_stats_stay_in_the_stream():
    meter = StreamTokens.of(view("chat", CHAT))
    chunk = {**chat_chunk("a"), "usage": {"completion_tokens": 1}}
    assert meter.feed(frame(chunk)) == frame(chunk)  # it has choices: the client's content


def test_a_native_batch_stream_sums_each_items_final_event():
    meter = StreamTokens.of(view("generate", {"text": ["a", "b"], "stream": True}))
    assert meter is not None and not meter.forced
    chunks = [frame(native(1, index=0)) + frame(native(1, index=1)),
              frame(native(2, index=1, finish={"type": "length", "length": 2})),
              frame(native(2, index=0)),
              frame(native(3, index=0, finish={"type": "stop"})) + DONE]
    assert [meter.feed(c) for c in chunks] == chunks  # nothing changes on the way
    assert meter.completion == 5


def test_a_single_stream_needs_no_meter():
    assert StreamTokens.of(view("generate", {"text": "a", "stream": True})) is None
    assert StreamTokens.of(view("chat", {**CHAT, "stream_options": {"include_usage": True}})) \
        is None
