"""The tools of an OpenAI chat request as SGLang 0.5.23 hands them to the chat template.

Mirrored: `protocol.py` `Tool` / `Function` `model_dump()` (`Function._serialize`: the client's
key order first, then the fields it left out; `strict` and `defer_loading` only when set; the
tool's `defer_loading` copied into its function), `serving_chat.py` `_validate_request`'s tool
checks and `_process_messages`' choice of the template's `tools` (none for `tool_choice`
"none", only the named one for a named choice, message-level tools stay in their message),
and `function_call/utils.py` `normalize_json_schema_types`, which rewrites DB-style types in
the parameters of request tools and system/developer/root message tools in place, so the
template renders the rewritten schema.
"""

from __future__ import annotations

import copy
from typing import Any

from gateway.tokens.chat_template import RejectedRequest

TOOL_HOST_ROLES = ("root", "system", "developer")


def checked(value: Any, kind: type, what: str) -> Any:
    """An optional field of this type (bool is no int here), or RejectedRequest."""
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)
                              and kind is not bool):
        raise RejectedRequest(f"{what} has the wrong type")
    return value


def dump_tools(raw: Any, normalize: bool) -> list[dict] | None:
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
    tool_defer = checked(raw.get("defer_loading"), bool, "defer_loading")
    defer = checked(function.get("defer_loading"), bool, "defer_loading")
    if tool_defer is not None and defer is None:
        defer = tool_defer
    parameters = copy.deepcopy(function.get("parameters"))
    if normalize and parameters is not None:
        _normalize_schema(parameters)
    data = {"description": checked(function.get("description"), str, "description"),
            "name": function["name"], "parameters": parameters,
            "strict": checked(function.get("strict"), bool, "strict"), "defer_loading": defer}
    if defer is None:
        del data["defer_loading"]
    if data["strict"] is None:
        del data["strict"]
    order = [k for k in function if k in data]
    order += [k for k in data if k not in order]
    return {"type": tool_type, "function": {k: data[k] for k in order},
            "defer_loading": tool_defer}


def template_tools(body: dict, request_tools: list[dict] | None,
                    messages: list[dict]) -> list[dict] | None:
    """`_validate_request`'s tool checks, then `_process_messages`' choice of `tools`."""
    host_tools = [t for m in messages if m["role"] in TOOL_HOST_ROLES and m.get("tools")
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
