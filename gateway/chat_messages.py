"""An OpenAI chat request body turned into what SGLang 0.5.23 hands its Jinja chat template.

Mirrored from `entrypoints/openai/`: `protocol.py` (`ChatCompletionRequest` and its message,
tool and content-part models: which fields survive `model_dump()`, `normalize_reasoning_inputs`,
`set_tool_choice_default`, `Function._serialize`'s key order), `serving_chat.py`
(`_validate_request`'s tool checks and `normalize_json_schema_types`,
`_convert_to_internal_request` popping `reasoning_effort` from `chat_template_kwargs`,
`_process_messages` choosing the template's `tools`, `_apply_jinja_template`: tool-call
arguments parsed as JSON, content `None` -> "", `process_content_for_template_format`,
`normalize_tool_content`, `_handle_last_assistant_message`, the extra template kwargs) and
`function_call/utils.py` (`normalize_json_schema_types`).

Only text is mirrored: media parts (images, audio, video) raise UnsupportedRequest. What
SGLang would refuse with 400 raises RejectedRequest.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from gateway.chat_template import RejectedRequest, UnsupportedRequest

_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder",
                  "root")
_TOOL_HOST_ROLES = ("root", "system", "developer")
_EFFORT_TIERS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_MEDIA_PARTS = ("image_url", "video_url", "audio_url", "input_audio")
_TRUTHY = {"1", "true", "yes", "y", "on"}


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
    request_tools = _tools(body.get("tools"), normalize=True)
    messages = [_message(m) for m in raw_messages]
    if not messages:
        raise RejectedRequest("Messages cannot be empty.")
    tools = _template_tools(body, request_tools, messages)
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
            if body.get("continue_final_message") is True:
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
            enabled = enabled.strip().lower() in _TRUTHY
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


def _opt(value: Any, kind: type | tuple, what: str) -> Any:
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)
                              and kind is not bool):
        raise RejectedRequest(f"{what} has the wrong type")
    return value


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
        "tool_call_id": _opt(raw.get("tool_call_id"), str, "tool_call_id"),
        "name": _opt(raw.get("name"), str, "name"),
        "phase": phase,
        "reasoning_content": _opt(raw.get("reasoning_content"), str, "reasoning_content"),
        "tool_calls": tool_calls,
        "tools": _tools(raw.get("tools"), normalize=role in _TOOL_HOST_ROLES),
        "prefix": _opt(raw.get("prefix"), bool, "prefix"),
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
            parts.append({"type": kind, "thinking": _opt(thinking, str, "thinking"),
                          "text": _opt(text, str, "text")})
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
    return {"id": _opt(raw.get("id"), str, "tool call id"),
            "index": _opt(raw.get("index"), int, "tool call index"),
            "type": "function",
            "function": {"name": _opt(function.get("name"), str, "tool call name"),
                         "arguments": copy.deepcopy(arguments)}}


def _tools(raw: Any, normalize: bool) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise RejectedRequest("tools must be a list")
    return [_tool(t, normalize) for t in raw]


def _tool(raw: Any, normalize: bool) -> dict:
    """`Tool(...).model_dump()`, `Function._serialize`: the client's key order first, then the
    fields it left out; `strict` and `defer_loading` only when set."""
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise RejectedRequest("a tool needs a function")
    function = raw["function"]
    if not isinstance(function.get("name"), str):
        raise RejectedRequest("a tool function needs a name")
    tool_type = raw.get("type", "function")
    if not isinstance(tool_type, str):
        raise RejectedRequest("tool type must be a string")
    tool_defer = _opt(raw.get("defer_loading"), bool, "defer_loading")
    defer = _opt(function.get("defer_loading"), bool, "defer_loading")
    if tool_defer is not None and defer is None:
        defer = tool_defer
    parameters = copy.deepcopy(function.get("parameters"))
    if normalize and parameters is not None:
        _normalize_schema(parameters)
    data = {"description": _opt(function.get("description"), str, "description"),
            "name": function["name"], "parameters": parameters,
            "strict": _opt(function.get("strict"), bool, "strict"), "defer_loading": defer}
    if defer is None:
        del data["defer_loading"]
    if data["strict"] is None:
        del data["strict"]
    order = [k for k in function if k in data]
    order += [k for k in data if k not in order]
    return {"type": tool_type, "function": {k: data[k] for k in order},
            "defer_loading": tool_defer}


def _template_tools(body: dict, request_tools: list[dict] | None,
                    messages: list[dict]) -> list[dict] | None:
    """`_validate_request`'s tool checks, then `_process_messages`' choice of `tools`."""
    host_tools = [t for m in messages if m["role"] in _TOOL_HOST_ROLES and m.get("tools")
                  for t in m["tools"]]
    effective = (request_tools or []) + host_tools
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if body.get("tools") is not None or host_tools else "none"
    names = [t["function"]["name"] for t in effective]
    if isinstance(choice, str):
        if choice not in ("auto", "required", "none"):
            raise RejectedRequest(f"bad tool_choice {choice!r}")
        if choice == "required" and not effective:
            raise RejectedRequest("Tools cannot be empty if tool choice is set to required.")
    else:
        function = choice.get("function") if isinstance(choice, dict) else None
        if not isinstance(function, dict) or choice.get("type", "function") != "function":
            raise RejectedRequest("bad tool_choice")
        if not effective:
            raise RejectedRequest("Tools cannot be empty if tool choice is set to a specific tool.")
        if function.get("name") not in names:
            raise RejectedRequest(f"Tool {function.get('name')!r} not found in tools list.")
    if host_tools and len(names) != len(set(names)):
        raise RejectedRequest("Tool names must be unique across request and message tools.")
    if not effective or choice == "none":
        return None
    if not isinstance(choice, str):
        wanted = choice["function"]["name"]
        return [t for t in request_tools or [] if t["function"]["name"] == wanted] or None
    return request_tools or None


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


_STANDARD_TYPES = {"null", "boolean", "object", "array", "number", "string", "integer"}
_TYPE_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum", "uuid", "date", "datetime",
                     "time", "timestamp", "binary", "blob", "bytea", "bytes", "varbinary"),
                    "string"),
    "bool": "boolean", "bigint": "integer", "smallint": "integer", "tinyint": "integer",
    **dict.fromkeys(("double", "decimal", "real", "numeric"), "number"),
    **dict.fromkeys(("arr", "tuple", "set"), "array"), "map": "object",
}
_PREFIX_RULES = ((("int", "uint", "long", "short", "unsigned"), "integer"),
                 (("num", "float"), "number"), (("list",), "array"), (("dict",), "object"))
_PREFIX_BOUNDARY = frozenset("0123456789[<( \t")


def _normalize_type(raw: Any) -> Any:
    if not isinstance(raw, str) or raw in _STANDARD_TYPES:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in _STANDARD_TYPES:
        return base
    if base in _TYPE_ALIASES:
        return _TYPE_ALIASES[base]
    for prefixes, target in _PREFIX_RULES:
        for p in prefixes:
            if base == p or (len(base) > len(p) and base.startswith(p)
                             and base[len(p)] in _PREFIX_BOUNDARY):
                return target
    return raw


def _normalize_schema(schema: Any) -> None:
    """`normalize_json_schema_types`: DB-style type names rewritten in place; the rewritten
    schema is what the template renders."""
    if isinstance(schema, list):
        for item in schema:
            _normalize_schema(item)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    if isinstance(kind, str):
        schema["type"] = _normalize_type(kind)
    elif isinstance(kind, list):
        normalized: list = []
        for item in kind:
            item = _normalize_type(item)
            if item not in normalized:
                normalized.append(item)
        schema["type"] = normalized
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(schema.get(key), dict):
            for value in schema[key].values():
                _normalize_schema(value)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            for value in schema[key]:
                _normalize_schema(value)
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                "propertyNames", "unevaluatedItems", "unevaluatedProperties"):
        if key in schema:
            _normalize_schema(schema[key])
