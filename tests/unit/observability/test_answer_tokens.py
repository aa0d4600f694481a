"""Completion tokens read from answers without parsing every streamed chunk."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from gateway.observability.answer_tokens import (
    TRAILING,
    StreamTokens,
    completion_final,
    completion_total,
    leg_stream_options,
    relayed_tokens,
    text_events,
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


# -- a stream cut before its usage event (answer_tokens.relayed_tokens) ---------------------

def delta(finish: object = None, **fields) -> bytes:
    return frame({"id": "c", "object": "chat.completion.chunk",
                  "choices": [{"index": 0, "delta": fields, "finish_reason": finish}]})


ROLE = delta(role="assistant", content="")
FINISH = delta(finish="length")


def text(piece: str, finish: object = None) -> bytes:
    return frame({"id": "c", "object": "text_completion",
                  "choices": [{"index": 0, "text": piece, "finish_reason": finish}]})


def kept(*chunks: bytes) -> SimpleNamespace:
    """What relay.Capture holds for a resumable stream."""
    return SimpleNamespace(usable=True, chunks=list(chunks), size=sum(map(len, chunks)))


def test_a_kept_stream_counts_each_event_with_text_however_it_was_read():
    """Read in 2 chunks, 4 events with text: 4 (the role event and the finish carry none),
    where the chunks alone say 2 (the last one's 2; the first may be the role event's)."""
    chunks = (ROLE + delta(content="a") + delta(content="b"),
              delta(content="c") + delta(content=TRICKY) + FINISH)
    assert relayed_tokens("chat", 2, chunks[-1], kept(*chunks)) == 4
    assert relayed_tokens("chat", 2, chunks[-1], None) == 2


def test_a_slow_clients_stream_read_in_few_chunks_counts_every_event_kept():
    """A client that reads slowly lets the decode run ahead once the buffers are full: each
    read holds many events, and one per chunk would let it pay for a fraction. Kept, they
    are counted."""
    chunks = [ROLE + delta(content="a"), delta(content="b"), delta(content="c") * 40,
              delta(content="d") * 40]
    assert relayed_tokens("chat", 4, chunks[-1], kept(*chunks)) == 82
    assert relayed_tokens("chat", 4, chunks[-1], None) == 42  # not kept: a lower bound
    steady = [ROLE + delta(content="a")] + [delta(content="b")] * 9  # no scan: by the chunks
    assert relayed_tokens("chat", 10, steady[-1], kept(*steady)) == 10  # the first holds 2
    assert relayed_tokens("chat", 10, steady[-1], None) == 9  # its first may be the role's


def test_a_step_that_ends_the_reasoning_counts_once():
    """SGLang's reasoning parser can give one step two events (the reasoning's end, then the
    answer's start): counted as one, so the figure stays at most the tokens."""
    events = [ROLE, delta(reasoning_content="think"), delta(reasoning_content="more"),
              delta(content="so"), delta(content="yes"), FINISH]
    assert text_events(b"".join(events), "chat") == 3
    tool = [{"index": 0, "id": "t", "function": {"name": "f", "arguments": ""}}]
    events = [ROLE, delta(content="call:"), delta(tool_calls=tool), delta(tool_calls=tool)]
    assert text_events(b"".join(events), "chat") == 2


@pytest.mark.parametrize("event, has_text", [
    (delta(content=TRICKY), True),
    (delta(content='"'), True),  # an escaped quote is text
    (delta(content=""), False),
    (delta(content=None, role=None, tool_calls=None, reasoning_content=None), False),
    (delta(tool_calls=[]), False),
    (b'data: {"choices": [{"delta": {"content": "spaced"}}]}\n\n', True),
    (b'data: {"choices": [{"delta": {"content": ""}}]}\n\n', False),
    (frame({"choices": [{"index": 0, "delta": {"content": None}, "finish_reason": None,
                         "logprobs": {"content": [{"token": "a", "logprob": -1.0}]}}]}), False),
], ids=["text-naming-keys", "a-quote", "empty", "nulls", "no-tool-call", "spaced-json",
        "spaced-empty", "logprobs-content-list"])
def test_only_a_key_with_new_text_is_counted(event, has_text):
    """A byte scan, no parse: a key's value must be a string that is not empty (or a tool
    call); text naming the keys is escaped inside its JSON string and never matches."""
    assert text_events(event, "chat") == has_text


@pytest.mark.parametrize("chunks, expected", [
    ([ROLE, delta(content="a"), delta(content="b"), delta(content="c")], 3),
    ([ROLE + delta(content="a"), delta(content="b"), delta(content="c")], 2),
    ([ROLE, delta(content="a"), delta(content="b") + FINISH], 2),
    ([ROLE, delta(content="a"), delta(content="b"), FINISH], 2),
    ([ROLE] + [delta(content="x")] * 9 + [FINISH, DONE], 11 - 1 - TRAILING),
    ([ROLE + delta(content="a") + delta(content="b")], 2),
    ([ROLE], 0),
], ids=["one-event-a-read", "role-and-text-read-together", "finish-with-the-last-text",
        "finish-alone", "last-chunk-after-the-finish", "one-read", "role-only"])
def test_a_stream_not_kept_counts_one_per_chunk_but_those_that_may_hold_no_text(chunks,
                                                                                expected):
    """Not kept (not resumable: tools, logprobs...): the last chunk read exactly, one per
    earlier chunk, less the role event's and, when the last chunk has neither text nor a
    finish, the events that may follow a choice's last token (`TRAILING`)."""
    assert relayed_tokens("chat", len(chunks), chunks[-1], None) == expected


def test_a_completions_stream_counts_its_events_with_text():
    """An event of empty text is a step whose token completed no character (a held byte):
    one per chunk counts it; the scan of coalesced events does not (a lower bound still)."""
    events = [text("a"), text(""), text("b"), text("", finish="length")]
    assert relayed_tokens("completions", 4, events[-1], kept(*events)) == 3
    assert relayed_tokens("completions", 3, events[2], None) == 3
    chunks = [events[0] + events[1], events[2] + events[3]]
    assert relayed_tokens("completions", 2, chunks[-1], kept(*chunks)) == 2


def test_a_streams_own_usage_event_is_its_count():
    """A sample of n > 1 that ended: its usage event (which the merged stream holds back)
    says what it generated."""
    last = FINISH + frame(USAGE_CHUNK) + DONE
    assert relayed_tokens("chat", 9, last, kept(ROLE, delta(content="a"), last)) == 5


def test_a_capture_past_its_limit_still_counts_its_chunks(monkeypatch):
    """Past its limit a capture keeps no chunk, only how many (the count a stream cut
    before its usage event falls back to)."""
    from gateway.dispatch import relay

    monkeypatch.setattr(relay, "CAPTURE_LIMIT", 250)
    capture = relay.Capture()
    for piece in "abcde":
        capture.add(delta(content=piece))
    assert not capture.usable and capture.chunks == [] and capture.past == 5
    assert relayed_tokens("chat", capture.past, delta(content="e"), capture) == 4
