"""A `/v1/messages` body as a `RequestView`: checked once, its routing key the conversation.

The checks are the ones SGLang 0.5.23 makes before any work (entrypoints/anthropic/): its
pydantic models in `protocol.py` (`AnthropicMessagesRequest`: `model` a string, `max_tokens` a
positive integer, `messages` a non-empty list of `user`/`assistant`/`system` turns whose content
is a string or a list of typed blocks, each block's fields, a `tool_result`'s nested blocks,
`stop_sequences`, `tools`, `tool_choice`) and the refusals of `AnthropicServing.
_convert_to_chat_completion_request` (a `tool_choice` no custom tool can meet, `redacted_thinking`
in an assistant turn). A body SGLang would refuse is refused here (400), so it takes no slot and
no leg. Left to the server (its 400 comes back in Anthropic's envelope): `thinking`,
`output_config` and the sampling numbers, server tools' optional fields. Of the chat request
the conversion makes, what SGLang's chat model refuses is refused here too: a user turn whose
tool calls come with no content (`_calls_alone`).

The routing key is the conversation as SGLang converts it to chat
(`AnthropicServing._convert_to_chat_completion_request`): the system prompt first, then each
turn's text, tool calls and tool results, rendered like a chat's (`request.render_messages`),
so a conversation's next turn extends its previous turn's key and finds its prefill.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

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
    fetches = reach.items_fetch(body["messages"], "messages")  # (a file path: 400)
    view = RequestView(endpoint=endpoint, body=body, stream=stream, batch_size=None, n=1,
                       routing_text=text, routing_tokens=None, prompt_tokens=(len(text) + tools_chars(body)) // 4 + 1,
                       model=body["model"], logprob_merge=False,
                       needs=frozenset((reach.MEDIA_URLS,)) if fetches else reach.NOTHING)
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
    for name in ("stop_sequences", "betas"):  # Optional[list[str]] in AnthropicMessagesRequest
        _field(body, name, _STRS, optional=True)
    _field(body, "metadata", _OBJ, optional=True)
    check_messages(body)


def check_messages(body: dict) -> None:
    """What a messages and a count_tokens body share: `messages`, `system`, `tools`,
    `tool_choice` (`AnthropicCountTokensRequest` has them all, and SGLang converts it as a
    messages request, with the same refusals)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"'messages[{i}].role' must be one of 'user', 'assistant', "
                             "'system'")
        content = message.get("content")
        _content(content, f"messages[{i}].content")
        # _convert_assistant_thinking_blocks: its bytes are Anthropic's to decrypt
        if message["role"] == "assistant" and isinstance(content, list) and any(
                block["type"] == "redacted_thinking" for block in content):
            raise BadRequest(f"'messages[{i}]': Anthropic redacted_thinking history is not "
                             "supported")
        if message["role"] == "user" and isinstance(content, list) and _calls_alone(content):
            raise BadRequest(f"'messages[{i}]': a user turn's tool_use blocks need a text, "
                             "image or search_result block after its last tool_result: "
                             "tool calls alone make a user chat message without content")
    system = body.get("system")
    if system is not None:
        _content(system, "system", converted=False)
    _tool_choice(body.get("tool_choice"), _custom_tools(body.get("tools")))


# -- the chat message a user turn's blocks become ---------------------------------------------


def _calls_alone(blocks: list[dict]) -> bool:
    """Whether SGLang's conversion (`AnthropicServing._convert_to_chat_completion_request`)
    makes of this user turn a chat message of `tool_calls` without `content`, which
    `ChatCompletionRequest` refuses (openai/protocol.py: `ChatCompletionMessageUserParam`
    requires `content`; only the generic roles may omit it). The conversion puts a turn's
    `tool_use` blocks in its message's `tool_calls`, and its content parts after the last
    `tool_result` (each flushes the parts before it, `_emit_user_message`) in `content`."""
    if not any(block["type"] == "tool_use" for block in blocks):
        return False
    last = max((j for j, block in enumerate(blocks) if block["type"] == "tool_result"),
               default=-1)
    return not any(map(_makes_part, blocks[last + 1:]))


def _makes_part(block: dict) -> bool:
    """Whether the conversion makes a content part of this block of a turn: a text (its
    `text`, a string, is never None), an image whose source it can read
    (`_convert_anthropic_image_source_to_openai_part`), a search result with some text
    (`_text_from_search_result`); thinking, tool calls, tool results, references make none."""
    kind, source = block["type"], block.get("source")
    if kind == "text":
        return True
    if kind == "image":
        if not isinstance(source, dict):
            return False
        return bool(source.get("data") if source.get("type") == "base64" else source.get("url"))
    if kind != "search_result":
        return False
    cited = (source.get("url") or source.get("text")) if isinstance(source, dict) else source
    return bool(block.get("title") or cited or any(
        part.get("type") == "text" and part.get("text") for part in block.get("content") or ()))


# -- protocol.py's models, as plain checks ------------------------------------------------------

Check = tuple[Callable[[Any], bool], str]  # a value's test, and what the message says it must be
_STR: Check = (lambda v: isinstance(v, str), "a string")
_OBJ: Check = (lambda v: isinstance(v, dict), "an object")
_STR_OR_OBJ: Check = (lambda v: isinstance(v, (str, dict)), "a string or an object")
_STRS: Check = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "a list of strings")
_OBJS: Check = (lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
                "a list of objects")
_TRUTHS = {"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"}
_BOOL: Check = (lambda v: isinstance(v, bool) or (type(v) in (int, float) and v in (0, 1))
                or (isinstance(v, str) and v.lower() in _TRUTHS), "a boolean")  # pydantic lax
REQUIRED, OPTIONAL, DEFAULT = "required", "optional", "default"  # DEFAULT: absent, never null
# AnthropicContentBlock's members: each field pydantic checks, how, and whether it may be absent
BLOCKS: dict[str, dict[str, tuple[Check, str]]] = {
    "text": {"text": (_STR, REQUIRED)},
    "image": {"source": (_STR_OR_OBJ, OPTIONAL)},
    "tool_use": {"id": (_STR, REQUIRED), "name": (_STR, REQUIRED), "input": (_OBJ, DEFAULT)},
    "tool_result": {"tool_use_id": (_STR, OPTIONAL), "id": (_STR, OPTIONAL),
                    "is_error": (_BOOL, OPTIONAL)},  # content: nested blocks, in _content
    "tool_reference": {"name": (_STR, OPTIONAL), "tool_name": (_STR, OPTIONAL),
                       "id": (_STR, OPTIONAL)},
    "search_result": {"source": (_STR_OR_OBJ, OPTIONAL), "title": (_STR, OPTIONAL),
                      "content": (_OBJS, OPTIONAL)},
    "thinking": {"thinking": (_STR, REQUIRED), "signature": (_STR, OPTIONAL)},
    "redacted_thinking": {"data": (_STR, OPTIONAL)},
}
# AnthropicTool's server-tool families (_tool_discriminator): type prefix, the names allowed,
# whether `name` must be given (the others default it)
SERVER_TOOLS = {"web_search_": (("web_search",), False), "computer_": (("computer",), False),
                "bash_": (("bash",), False),
                "text_editor_": (("str_replace_editor", "str_replace_based_edit_tool"), True)}
CHOICES = ("auto", "any", "tool", "none")  # AnthropicToolChoice.type


def _field(obj: dict, name: str, check: Check, where: str = "", optional: bool = False,
           required: bool = False) -> None:
    """One field as pydantic checks it: absent is fine unless `required`, null only if
    `optional`, else the value must pass `check`."""
    if name not in obj:
        if required:
            raise BadRequest(f"'{where}{name}' is required")
        return
    value = obj[name]
    if value is None and optional:
        return
    if not check[0](value):
        raise BadRequest(f"'{where}{name}' must be {check[1]}")


def _content(content: Any, where: str, converted: bool = True) -> None:
    """`Union[str, list[AnthropicContentBlock]]`, a tool_result's content nested likewise;
    `converted`: SGLang converts these blocks (a turn's; of `system` it reads text only)."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string or a list of content blocks")
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        fields = BLOCKS.get(kind) if isinstance(kind, str) else None
        if fields is None:
            raise BadRequest(f"'{where}[{j}]' must be a content block: an object whose 'type' "
                             f"is one of {', '.join(BLOCKS)}")
        for name, (test, need) in fields.items():
            _field(block, name, test, f"{where}[{j}].", need == OPTIONAL, need == REQUIRED)
        if kind == "tool_result" and block.get("content") is not None:
            _content(block["content"], f"{where}[{j}].content", converted)
        if kind == "search_result" and converted and any(  # _text_from_search_result joins
                part.get("type") == "text" and part.get("text")  # these texts
                and not isinstance(part["text"], str) for part in block.get("content") or ()):
            raise BadRequest(f"'{where}[{j}].content': a text part's 'text' must be a string")


def _custom_tools(tools: Any) -> set[str]:
    """`tools` as `list[AnthropicTool]` checks it; the names of its custom tools (the ones
    SGLang forwards: server tools are dropped)."""
    if tools is None:
        return set()
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of objects")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]."
        if not isinstance(tool, dict):
            raise BadRequest(f"'tools[{i}]' must be an object")
        kind = tool.get("type")
        family = next((p for p in SERVER_TOOLS if isinstance(kind, str) and kind.startswith(p)),
                      None)
        if family is not None:  # AnthropicWebSearchTool and its kin
            if not re.fullmatch(re.escape(family) + r"\d{8}", kind):
                raise BadRequest(f"'{where}type' must be {family}YYYYMMDD")
            allowed, required = SERVER_TOOLS[family]
            _field(tool, "name", (allowed.__contains__, f"one of {', '.join(allowed)}"), where,
                   required=required)
        elif kind not in (None, "custom"):  # AnthropicCustomTool.type: Optional[Literal]
            raise BadRequest(f"'{where}type' must be 'custom' or a server tool's type")
        else:
            _field(tool, "name", _STR, where, required=True)
            _field(tool, "input_schema", _OBJ, where, required=True)
            _field(tool, "strict", _BOOL, where)
            names.add(tool["name"])
        _field(tool, "description", _STR, where, optional=True)
        _field(tool, "defer_loading", _BOOL, where, optional=True)
    return names


def _tool_choice(choice: Any, custom: set[str]) -> None:
    """`AnthropicToolChoice`, then the conversion's rule: `any` or `tool` need a custom tool
    to call, and `tool` one of that name (a server tool cannot be chosen)."""
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in CHOICES:
        raise BadRequest(f"'tool_choice' must be an object whose 'type' is one of "
                         f"{', '.join(CHOICES)}")
    _field(choice, "name", _STR, "tool_choice.", optional=True)
    _field(choice, "disable_parallel_tool_use", _BOOL, "tool_choice.")
    kind = choice["type"]
    if kind in ("any", "tool") and not custom:
        raise BadRequest(f"tool_choice={kind!r} requires at least one custom tool")
    if kind == "tool" and choice.get("name") not in custom:
        raise BadRequest(f"tool_choice references tool {choice.get('name')!r} but it is not "
                         "in the tools list")


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
