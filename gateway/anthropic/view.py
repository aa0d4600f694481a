"""A `/v1/messages` body as a `RequestView`: checked once, its routing key the conversation.

The checks are the ones SGLang's `AnthropicMessagesRequest` (entrypoints/anthropic/protocol.py)
makes before any work: `model` a string, `max_tokens` a positive integer, `messages` a
non-empty list of `user`/`assistant`/`system` turns whose content is a string or a list of
typed blocks. A body SGLang would refuse is refused here (400), so it takes no slot and no leg.

The routing key is the conversation as SGLang converts it to chat
(`AnthropicServing._convert_to_chat_completion_request`): the system prompt first, then each
turn's text, tool calls and tool results, rendered like a chat's (`request.render_messages`),
so a conversation's next turn extends its previous turn's key and finds its prefill.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.dispatch.inflight import client_rids
from gateway.errors import BadRequest
from gateway.request import DP_FIELDS, PD_FIELDS, RequestView, json_object, render_messages

ROLES = ("user", "assistant", "system")


def parse_messages(endpoint: str, raw: bytes | bytearray) -> RequestView:
    """The view of a `/v1/messages` body, or BadRequest naming the field."""
    body = json_object(raw)
    for name in PD_FIELDS + DP_FIELDS:
        if body.get(name) is not None:
            raise BadRequest(f"'{name}' is assigned by the gateway; do not send it")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    check(body)
    text = render_messages(conversation(body))
    view = RequestView(endpoint=endpoint, body=body, stream=stream, batch_size=None, n=1,
                       routing_text=text, routing_tokens=None, prompt_tokens=len(text) // 4 + 1,
                       model=body["model"], logprob_merge=False)
    view.size, view.source = len(raw), (body, raw)
    view.rids = client_rids(body.get("rid"), None)
    return view




def check(body: dict) -> None:
    """Raise BadRequest naming the first field SGLang would refuse."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string")
    tokens = body.get("max_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise BadRequest("'max_tokens' is required and must be a positive integer")
    check_messages(body)


def check_messages(body: dict) -> None:
    """The `messages` (and `system`) of a messages or count_tokens body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"'messages[{i}].role' must be one of 'user', 'assistant', "
                             "'system'")
        _content(message.get("content"), f"messages[{i}].content")
    system = body.get("system")
    if system is not None:
        _content(system, "system")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be a list of objects")


def _content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"'{where}[{j}]' must be an object with a string 'type'")


def _text(content: Any) -> str:
    """A turn's text as SGLang's conversion keeps it: text blocks, tool calls (their JSON
    arguments), tool results; images and thinking leave no text here."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text") or ""))
        elif kind == "tool_use":
            parts.append(f"{block.get('name')}({_json(block.get('input'))})")
        elif kind == "tool_result":
            inner = block.get("content")
            parts.append(_text(inner) if isinstance(inner, (str, list)) else "")
    return "".join(parts)


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value or {}).decode()
    except orjson.JSONEncodeError:
        return ""


def conversation(body: dict) -> list[dict]:
    """The chat turns SGLang makes of the body: system first, then each message's text."""
    turns = []
    system = body.get("system")
    if system:
        turns.append({"role": "system", "content": _text(system)})
    turns.extend({"role": m["role"], "content": _text(m["content"])} for m in body["messages"])
    return turns
