"""An OpenAI chat request body turned into what SGLang 0.5.23 hands its Jinja chat template.

Mirrored from `entrypoints/openai/`: `protocol.py` (`ChatCompletionRequest` and its message
and content-part models: which fields survive `model_dump()`, role normalization,
`normalize_reasoning_inputs`, `set_tool_choice_default`), `serving_chat.py`
(`_convert_to_internal_request` popping `reasoning_effort` from `chat_template_kwargs`,
`_apply_jinja_template`: `normalize_assistant_tool_call_arguments` (arguments parsed as JSON),
content `None` -> "", `process_content_for_template_format` for the template's content format,
`normalize_tool_content`, `_handle_last_assistant_message`, the extra template kwargs). The
tools: gateway/tokens/tools.py.

Only text is mirrored: media parts (images, audio, video) raise UnsupportedRequest. What
SGLang would refuse with 400 raises RejectedRequest.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from gateway.tokens.chat_template import RejectedRequest, UnsupportedRequest
from gateway.tokens.tools import TOOL_HOST_ROLES, checked, dump_tools, template_tools

_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder",
                  "root")
_EFFORT_TIERS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_MEDIA_PARTS = ("image_url", "video_url", "audio_url", "input_audio")
_TRUTHY = {"1", "true", "yes", "y", "on", "t"}
_FALSY = {"0", "false", "no", "n", "off", "f"}


@dataclass
class PreparedChat:
    """The template's inputs; `assistant_prefix` is encoded and appended after rendering."""

    messages: list[dict]
    tools: list[dict] | None
    kwargs: dict[str, Any]
    assistant_prefix: str | None


def prepare_chat(body: Any, content_format: str) -> PreparedChat:
    if not isinstance(body, dict):
        raise RejectedRequest("the body is not a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list):
        raise RejectedRequest("messages must be a list")
    effort, kwargs = _reasoning_inputs(body)
    request_tools = dump_tools(body.get("tools"), normalize=True)
    messages = [_message(m) for m in raw_messages]
    if not messages:
        raise RejectedRequest("Messages cannot be empty.")
    tools = template_tools(body, request_tools, messages)
    if kwargs and "chat_template" in kwargs:
        raise UnsupportedRequest("a request-supplied chat_template")
    if kwargs and kwargs.get("reasoning_effort") is not None:
        effort = kwargs.pop("reasoning_effort")
    elif kwargs:
        kwargs.pop("reasoning_effort", None)
    for message in messages:
        _parse_tool_call_arguments(message)
    rendered = [_for_template(message, content_format) for message in messages]
    prefix = None
    if rendered and rendered[-1].get("role") == "assistant":
        last = rendered[-1].get("content")
        if isinstance(last, str):
            if _bool(body.get("continue_final_message", False), "continue_final_message"):
                prefix = last
                rendered = rendered[:-1]
            else:
                rendered[-1] = {"role": "user", "content": last}
    extra: dict[str, Any] = {}
    if effort is not None:
        extra["reasoning_effort"] = effort
    extra.update(kwargs or {})
    return PreparedChat(rendered, tools, extra, prefix)


def _reasoning_inputs(body: dict) -> tuple[Any, dict | None]:
    """`ChatCompletionRequest.normalize_reasoning_inputs` and the `reasoning_effort` field."""
    effort = body.get("reasoning_effort")
    thinking = None
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict):
        value = reasoning.get("effort")
        if value is None:
            value = reasoning.get("reasoning_effort")
        if isinstance(value, str) and value in _EFFORT_TIERS:
            effort = value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            effort = float(value)
        elif isinstance(value, str):
            try:
                effort = float(value)
            except ValueError:
                raise RejectedRequest(f"invalid reasoning effort: {value!r}") from None
        elif value is not None:
            raise RejectedRequest(f"invalid reasoning effort: {value!r}")
        enabled = reasoning.get("enabled")
        if enabled is None:
            enabled = reasoning.get("enable", False)
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in _TRUTHY - {"t"}
        if enabled:
            thinking = True
    if effort is not None:
        thinking = effort != "none"
    kwargs = body.get("chat_template_kwargs")
    if thinking is not None:
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        kwargs.setdefault("thinking", thinking)
        kwargs.setdefault("enable_thinking", thinking)
    elif kwargs is not None and not isinstance(kwargs, dict):
        raise RejectedRequest("chat_template_kwargs must be an object")
    else:
        kwargs = copy.deepcopy(kwargs)
    return _effort(effort), kwargs


def _effort(value: Any) -> Any:
    if value is None or (isinstance(value, str) and value in _EFFORT_TIERS):
        return value
    if isinstance(value, bool):
        raise RejectedRequest("reasoning_effort must not be a boolean")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise RejectedRequest(f"invalid reasoning_effort {value!r}") from None
    if isinstance(value, int | float) and 0.0 <= value <= 0.99:
        return float(value)
    raise RejectedRequest(f"invalid reasoning_effort {value!r}")


def _bool(value: Any, what: str) -> bool:
    """A pydantic (lax) bool field: booleans, 0/1 and the usual strings."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUTHY | _FALSY:
        return value.lower() in _TRUTHY
    raise RejectedRequest(f"{what} must be a boolean")


def _message(raw: Any) -> dict:
    """`ChatCompletionMessageParam(...).model_dump()`: unknown keys dropped, known ones with
    their defaults (None) in field order."""
    if not isinstance(raw, dict):
        raise RejectedRequest("each message must be an object")
    role = raw.get("role")
    if role == "user":
        if "content" not in raw or raw["content"] is None:
            raise RejectedRequest("a user message needs content")
        return {"role": "user", "content": _content(raw["content"], "user")}
    if not isinstance(role, str) or role.lower() not in _GENERIC_ROLES:
        raise RejectedRequest(f"unknown message role {role!r}")
    role = role.lower()
    tool_calls = raw.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise RejectedRequest("tool_calls must be a list")
        tool_calls = [_tool_call(c) for c in tool_calls]
    phase = raw.get("phase")
    if phase not in (None, "commentary", "final_answer"):
        raise RejectedRequest("phase must be commentary or final_answer")
    return {
        "role": role,
        "content": _content(raw.get("content"), role),
        "tool_call_id": checked(raw.get("tool_call_id"), str, "tool_call_id"),
        "name": checked(raw.get("name"), str, "name"),
        "phase": phase,
        "reasoning_content": checked(raw.get("reasoning_content"), str, "reasoning_content"),
        "tool_calls": tool_calls,
        "tools": dump_tools(raw.get("tools"), normalize=role in TOOL_HOST_ROLES),
        "prefix": checked(raw.get("prefix"), bool, "prefix"),
    }


def _content(content: Any, role: str) -> Any:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RejectedRequest("content must be a string or a list of parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("thinking", "reasoning"):
            thinking, text = part.get("thinking"), part.get("text")
            if (thinking is None) == (text is None) or role != "assistant":
                raise RejectedRequest("bad thinking part")
            parts.append({"type": kind, "thinking": checked(thinking, str, "thinking"),
                          "text": checked(text, str, "text")})
        elif kind == "tool_reference" and isinstance(part.get("name"), str):
            parts.append({"type": "tool_reference", "name": part["name"]})
        elif kind in _MEDIA_PARTS:
            raise UnsupportedRequest(f"{kind} content")
        else:
            raise RejectedRequest(f"unknown content part {kind!r}")
    return parts


def _tool_call(raw: Any) -> dict:
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise RejectedRequest("a tool call needs a function")
    if raw.get("type", "function") != "function":
        raise RejectedRequest("tool call type must be function")
    function = raw["function"]
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, str | dict):
        raise RejectedRequest("tool call arguments must be a string or an object")
    return {"id": checked(raw.get("id"), str, "tool call id"),
            "index": checked(raw.get("index"), int, "tool call index"),
            "type": "function",
            "function": {"name": checked(function.get("name"), str, "tool call name"),
                         "arguments": copy.deepcopy(arguments)}}


def _parse_tool_call_arguments(message: dict) -> None:
    """`normalize_assistant_tool_call_arguments(strict=True)`."""
    if message.get("role") != "assistant" or not isinstance(message.get("tool_calls"), list):
        return
    for call in message["tool_calls"]:
        function = call["function"]
        if isinstance(function.get("arguments"), str):
            try:
                parsed = json.loads(function["arguments"], parse_constant=_no_constant)
            except ValueError:
                raise RejectedRequest(
                    "Assistant tool call function.arguments must be valid JSON.") from None
            if not isinstance(parsed, dict):
                raise RejectedRequest(
                    "Assistant tool call function.arguments must be a JSON object.")
            function["arguments"] = parsed


def _no_constant(name: str) -> None:
    raise ValueError(name)  # orjson, which SGLang uses, refuses NaN and Infinity


def _for_template(message: dict, content_format: str) -> dict:
    """`process_content_for_template_format` and `normalize_tool_content`."""
    message = copy.deepcopy(message)
    if message.get("content") is None:
        message["content"] = ""
    content = message["content"]
    if isinstance(content, list) and content_format == "openai":
        parts = [p for p in content if p["type"] in ("text", "tool_reference")]
        message = {k: v for k, v in message.items() if v is not None and k != "content"}
        message["content"] = parts
    else:
        if isinstance(content, list):
            texts = [p["text"] for p in content if p["type"] == "text"]
            message["content"] = " ".join(texts) if texts else ""
        message = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if message["role"] == "tool" and isinstance(content, list) and all(
            p.get("type") == "text" for p in content):
        message["content"] = " ".join(p.get("text", "") for p in content)
    return message


