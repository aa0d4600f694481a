"""A /v1/messages body SGLang 0.5.23 would refuse is refused by `view.py` (400), and its twin
that SGLang accepts is not: each case pairs the two, a field apart (no sockets).

SGLang's rules: the pydantic models of entrypoints/anthropic/protocol.py (content blocks, a
`tool_result`'s nested blocks, `stop_sequences`, `tool_choice`, `tools`) and the refusals of
`AnthropicServing._convert_to_chat_completion_request` (`tool_choice` without a matching custom
tool, `redacted_thinking` history in an assistant turn), and of the chat request it makes, what
`ChatCompletionRequest` refuses (a user message of tool calls without content).
"""

from __future__ import annotations

import orjson
import pytest

from gateway.anthropic.view import check_messages, parse_messages
from gateway.errors import BadRequest
from gateway.request import MESSAGES

TOOLS = [{"name": "lookup", "input_schema": {"type": "object"}}]


def body(content=None, **extra) -> dict:
    turn = {"role": "user", "content": "hi" if content is None else content}
    return {"model": "m", "max_tokens": 8, "messages": [turn], **extra}


def result(inner) -> list[dict]:
    """A user turn holding one tool_result whose content is `inner`."""
    return [{"type": "tool_result", "tool_use_id": "toolu_1", "content": inner}]


def turns(role: str, blocks: list[dict]) -> dict:
    return {"model": "m", "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}, {"role": role, "content": blocks}]}


TEXT = {"type": "text", "text": "a"}
REDACTED = [{"type": "redacted_thinking", "data": "xyz"}, TEXT]
CALL = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}
RESULT = result("found")[0]
THINKING = {"type": "thinking", "thinking": "t"}

# (refused, accepted): the accepted twin differs in the one thing SGLang objects to
CASES = {
    "tool_result-content-string-item": (body(result(["a"])), body(result([TEXT]))),
    "tool_result-content-number-item": (body(result([1])), body(result("1"))),
    "tool_result-content-null-item": (body(result([None])), body(result(None))),
    "tool_result-content-nested-list": (body(result([[TEXT]])), body(result([TEXT]))),
    "tool_result-nested-block-unknown": (body(result([{"type": "x"}])), body(result([]))),
    "system-tool_result-string-item": (body(system=result(["x"])), body(system=result("x"))),
    "unknown-block-type": (body([{"type": "frobnicate"}]), body([TEXT])),
    "text-block-without-text": (body([{"type": "text"}]), body([TEXT])),
    "tool_use-input-not-object": (
        turns("assistant", [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]),
        turns("assistant", [{"type": "tool_use", "id": "t", "name": "f"}])),
    "stop_sequences-numbers": (body(stop_sequences=[1, 2]), body(stop_sequences=["1", "2"])),
    "tool_choice-names-undefined-tool": (
        body(tools=TOOLS, tool_choice={"type": "tool", "name": "other"}),
        body(tools=TOOLS, tool_choice={"type": "tool", "name": "lookup"})),
    "tool_choice-any-without-tools": (body(tool_choice={"type": "any"}),
                                      body(tool_choice={"type": "auto"})),
    "tool_choice-any-with-server-tools-only": (
        body(tools=[{"type": "web_search_20250305"}], tool_choice={"type": "any"}),
        body(tools=[{"type": "web_search_20250305"}], tool_choice={"type": "none"})),
    "tool_choice-unknown-type": (body(tool_choice={"type": "some"}),
                                 body(tool_choice={"type": "none"})),
    "tool-without-input_schema": (body(tools=[{"name": "f"}]), body(tools=TOOLS)),
    "redacted_thinking-in-assistant-turn": (turns("assistant", REDACTED),
                                            turns("user", REDACTED)),
    # a user turn's tool calls with no content part after its last tool_result make a user
    # chat message without content, which SGLang's ChatCompletionRequest refuses
    "user-turn-of-tool_use-alone": (body([CALL]), body([CALL, TEXT])),
    "tool_use-alone-in-a-user-not-an-assistant-turn": (body([CALL, CALL]),
                                                        turns("assistant", [CALL])),
    "user-turn-text-flushed-by-a-later-tool_result": (body([TEXT, CALL, RESULT]),
                                                       body([CALL, RESULT, TEXT])),
    "user-turn-tool_use-with-an-unreadable-image": (
        body([CALL, {"type": "image", "source": {"type": "base64", "data": ""}}]),
        body([CALL, {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}])),
    "user-turn-tool_use-with-an-empty-search_result": (
        body([CALL, {"type": "search_result", "content": [{"type": "text", "text": ""}]}]),
        body([CALL, {"type": "search_result", "source": {"url": "http://x"}}])),
    "user-turn-tool_use-with-thinking-only": (body([THINKING, CALL]), body([THINKING, CALL, TEXT])),
}


@pytest.mark.parametrize(("refused", "accepted"), list(CASES.values()), ids=list(CASES))
def test_refused_where_sglang_refuses_and_only_there(refused, accepted):
    with pytest.raises(BadRequest) as caught:
        parse_messages(MESSAGES, orjson.dumps(refused))
    assert caught.value.status == 400 and caught.value.message
    parse_messages(MESSAGES, orjson.dumps(accepted))


@pytest.mark.parametrize("inner", [["a"], [1], [None], [[TEXT]]],
                         ids=["string", "number", "null", "nested-list"])
def test_count_tokens_body_with_a_malformed_tool_result_is_refused(inner):
    """count_tokens shares these checks (`AnthropicCountTokensRequest` nests the same blocks)."""
    with pytest.raises(BadRequest):
        check_messages({"model": "m", "messages": [{"role": "user", "content": result(inner)}]})


def test_count_tokens_body_of_a_user_turn_of_tool_calls_alone_is_refused():
    """count_tokens converts the body as a messages request: the same chat model refuses it."""
    turn = {"role": "user", "content": [CALL]}
    with pytest.raises(BadRequest) as caught:
        check_messages({"model": "m", "messages": [turn]})
    assert "tool_use" in caught.value.message
