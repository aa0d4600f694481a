"""The chat prompt estimate (no tokenizer) that `--rate-limit-tokens` charges: it counts what
the chat template renders besides the messages' text (tools, tool calls, names, reasoning)."""

from __future__ import annotations

import orjson

from gateway.request import CHAT, parse_request


def estimate(body: dict) -> int:
    return parse_request(CHAT, orjson.dumps(body)).prompt_tokens


TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "d" * 4000,
    "parameters": {"type": "object", "properties": {"q": {"type": "string",
                                                          "description": "p" * 2000}}}}}


def test_tool_definitions_are_counted():
    """4 chat requests with ~38 KB of tools passed a 1,200 tokens/minute limit."""
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    with_tools = {**plain, "tools": [TOOL, TOOL]}
    assert estimate(plain) < 5
    assert estimate(with_tools) >= 2 * 6000 // 4


def test_tool_call_arguments_names_and_reasoning_are_counted():
    args = orjson.dumps({"text": "a" * 8000}).decode()
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "reasoning_content": "r" * 4000,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "lookup", "arguments": args}},
                        {"id": "c2", "type": "function",
                         "function": {"name": "lookup", "arguments": {"text": "b" * 4000}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "n" * 400, "content": "ok"},
    ]
    assert estimate({"messages": messages}) >= (8000 + 4000 + 4000 + 400) // 4


def test_the_same_text_as_content_or_as_tool_calls_costs_about_the_same():
    text = "word " * 2000
    as_content = estimate({"messages": [{"role": "user", "content": text}]})
    as_call = estimate({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": text}}]}]})
    assert abs(as_content - as_call) < 20


def test_malformed_tool_calls_do_not_break_the_estimate():
    """Shapes SGLang itself refuses are its to refuse (400 there): the estimate skips them."""
    body = {"messages": [{"role": "assistant", "content": "x", "name": 3,
                          "tool_calls": ["not a call", {"function": "nope"}, {"x": 1}]}]}
    assert estimate(body) >= 1


def test_messages_and_responses_count_their_tool_definitions():
    """The Messages and Responses estimates ignored `tools`: ~12 KB of definitions cost the
    token limit nothing there while chat charged them (2026-12-07)."""
    from gateway.anthropic.view import parse_messages
    from gateway.responses.view import parse_responses

    schema = {"type": "object", "properties": {"q": {"type": "string", "description": "p" * 2000}}}
    custom = {"name": "lookup", "description": "d" * 4000, "input_schema": schema}
    plain = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    bare = parse_messages("messages", orjson.dumps(plain)).prompt_tokens
    tooled = parse_messages("messages", orjson.dumps({**plain, "tools": [custom, custom]}))
    assert bare < 10 and tooled.prompt_tokens >= 2 * 6000 // 4

    function = {"type": "function", "name": "lookup", "description": "d" * 4000,
                "parameters": schema}
    asked = {"model": "m", "input": "hi"}
    bare = parse_responses("responses", orjson.dumps(asked)).prompt_tokens
    tooled = parse_responses("responses", orjson.dumps({**asked, "tools": [function] * 2}))
    assert bare < 10 and tooled.prompt_tokens >= 2 * 6000 // 4
