"""A Responses body as a `RequestView`: validated once, its routing key the conversation.

The key is the same rendering the chat path uses (`request.render_messages`) of the messages
SGLang makes from the input items (`OpenAIServingResponses._construct_input_messages`:
instructions first as a system message, then each item as a chat message). The gateway gives
the servers the whole conversation (history.expand), so turn N+1's key starts with turn N's:
the prefix policies send a conversation back to the prefill that holds its prefix.
"""

from __future__ import annotations

from gateway import reach
from gateway.dispatch.inflight import client_rids
from gateway.errors import BadRequest
from gateway.request import (
    DP_FIELDS,
    PD_FIELDS,
    RequestView,
    json_object,
    render_messages,
    tools_chars,
)


def parse_responses(endpoint: str, raw: bytes | bytearray) -> RequestView:
    """The view of a body the Responses endpoint prepared (history expanded, its rid set)."""
    body = json_object(raw)
    check_owned(body)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    text = render_messages(messages_of(body))
    fetches = reach.items_fetch(body.get("input"), "input")  # (a file path: 400)
    view = RequestView(endpoint=endpoint, body=body, stream=stream, batch_size=None, n=1,
                       routing_text=text, routing_tokens=None, prompt_tokens=(len(text) + tools_chars(body)) // 4 + 1,
                       model=model, logprob_merge=False,
                       needs=frozenset((reach.MEDIA_URLS,)) if fetches else reach.NOTHING)
    view.size, view.source = len(raw), (body, raw)
    view.rids = client_rids(body.get("rid"), None)
    return view


def check_owned(body: dict) -> None:
    """Refuse the fields the gateway sets on the legs (docs/SECURITY.md)."""
    for name in PD_FIELDS + DP_FIELDS:
        if body.get(name) is not None:
            raise BadRequest(f"'{name}' is assigned by the gateway; do not send it")


def input_items(value: object) -> list:
    """The input as a list of items: a string is one user message (SGLang's
    `_response_input_history` turns it into the same)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return value
    raise BadRequest("'input' must be a string or a list of input items (objects)")


def messages_of(body: dict) -> list[dict]:
    """The chat messages SGLang makes of the body (for the routing key only)."""
    messages = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    for item in input_items(body.get("input")):
        message = _message(item)
        if message is not None:
            messages.append(message)
    return messages


def _message(item: dict) -> dict | None:
    kind = item.get("type")
    if kind == "function_call":
        return {"role": "assistant",
                "content": f"{item.get('name', '')}({item.get('arguments', '')})"}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output if isinstance(output, str) else ""}
    if kind == "reasoning" or not isinstance(item.get("role"), str):
        return None
    content = item.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content
                          if isinstance(p, dict) and isinstance(p.get("text", ""), str))
    return {"role": item["role"], "content": content if isinstance(content, str) else ""}
