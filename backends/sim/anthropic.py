"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

Mirrors sglang/srt/entrypoints/anthropic/ (0.5.23): the request is validated by the pydantic
models of `protocol.py` (a failure is http_server's `validation_exception_handler` for
/v1/messages: 400 in Anthropic's envelope, "loc: msg"), converted to a chat request
(`AnthropicServing._convert_to_chat_completion_request`, which carries the PD routing fields
over with `pd_routing_kwargs()` and nothing else: a `rid` in the body is dropped), served as
chat (PD legs as for chat: openai.py), and its answer converted back (`_convert_response`,
`_generate_anthropic_stream`, `_convert_openai_error_response`). The sim's chat template
renders every role, so inline system messages stay in place (`supports_inline_system`).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from backends.sim import cuts, faults, tokenizer
from backends.sim.job import Job
from backends.sim.native import make_jobs, read_json
from backends.sim.outputs import usage
from backends.sim.requests import BadRequest, openai_to_generate, parse_generate
from backends.sim.responses import respond
from backends.sim.state import SimState

ENDPOINT = "/v1/messages"
# PDRoutingFields (entrypoints/openai/protocol.py): what pd_routing_kwargs() carries over
PD_ROUTING = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
              "disagg_prefill_dp_rank")
STOP_REASON_MAP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPE_MAP = {400: "invalid_request_error", 401: "authentication_error",
                  403: "permission_error", 404: "not_found_error", 408: "request_timeout_error",
                  429: "rate_limit_error", 500: "api_error", 502: "api_error",
                  503: "overloaded_error", 504: "api_error"}
ROLES = ("user", "assistant", "system")
BLOCKS = ("text", "image", "tool_use", "tool_result", "tool_reference", "search_result",
          "thinking", "redacted_thinking")
SERVER_TOOL_PREFIXES = ("web_search_", "computer_", "bash_", "text_editor_")


def error(status: int, error_type: str, message: str) -> JSONResponse:
    """`_anthropic_error_response` / `AnthropicServing._error_response`."""
    return JSONResponse({"type": "error", "error": {"type": error_type, "message": message}},
                        status_code=status)


def _scrub(message: str, status: int) -> str:
    """`_scrub_error_message`: a 5xx never echoes upstream detail."""
    if status >= 500:
        return "Internal server error"
    return message[:500] if message else "Request failed"


# -- validation (protocol.AnthropicMessagesRequest / AnthropicCountTokensRequest) ------------

def validate(body: Any, counting: bool) -> list[str]:
    """Pydantic's complaints as `_anthropic_validation_message` renders them ("loc: msg")."""
    if not isinstance(body, dict):
        return ["Input should be a valid dictionary or object to extract fields from"]
    errors = []
    model = body.get("model")
    if not isinstance(model, str):
        errors.append("model: Field required" if model is None else
                      "model: Input should be a valid string")
    elif not model and not counting:
        errors.append("model: Value error, Model is required")
    if not counting:
        tokens = body.get("max_tokens")
        if tokens is None:
            errors.append("max_tokens: Field required")
        elif isinstance(tokens, bool) or not isinstance(tokens, int):
            errors.append("max_tokens: Input should be a valid integer")
        elif tokens <= 0:
            errors.append("max_tokens: Value error, max_tokens must be positive")
    messages = body.get("messages")
    if not isinstance(messages, list):
        errors.append("messages: Field required" if messages is None else
                      "messages: Input should be a valid list")
        return errors
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            errors.append(f"messages.{i}.role: Input should be 'user', 'assistant' or 'system'")
            continue
        content = msg.get("content")
        if isinstance(content, list):
            for j, block in enumerate(content):
                if not isinstance(block, dict) or block.get("type") not in BLOCKS:
                    errors.append(f"messages.{i}.content.{j}: Input tag does not match any of "
                                  "the expected tags")
        elif not isinstance(content, str):
            errors.append(f"messages.{i}.content: Input should be a valid string")
    return errors


# -- conversion (AnthropicServing._convert_to_chat_completion_request) ------------------------

def _tool_result(block: dict, role: str) -> tuple[list[str], str]:
    """`_convert_tool_result_content` for the text a sim can render."""
    content = block.get("content")
    if isinstance(content, list):
        texts = [str(p.get("text", "")) for p in content
                 if isinstance(p, dict) and p.get("type") == "text" and p.get("text")]
        text = "\n".join(texts)
        return (texts or [""]), text
    text = str(content) if content else ""
    return [text], text


def _blocks(msg: dict, out: list[dict]) -> None:
    """One message of content blocks: text parts, tool calls, tool results as tool messages."""
    role = msg["role"]
    if any(b.get("type") == "redacted_thinking" for b in msg["content"]) and role == "assistant":
        raise ValueError("Anthropic redacted_thinking history is not supported")
    parts: list[dict] = []
    calls: list[dict] = []
    for block in msg["content"]:
        kind = block.get("type")
        if kind == "text" and block.get("text") is not None:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or f"call_{uuid.uuid4().hex}", "type": "function",
                          "function": {"name": block.get("name") or "",
                                       "arguments": orjson.dumps(block.get("input") or {})
                                       .decode()}})
        elif kind == "tool_result":
            contents, text = _tool_result(block, role)
            if role == "user":  # _emit_user_message: text before the result stays before it
                if parts:
                    out.append({"role": "user", "content": _joined(parts)})
                    parts = []
                call_id = block.get("tool_use_id") or block.get("id") or ""
                out.extend({"role": "tool", "tool_call_id": call_id, "content": c}
                           for c in contents)
            else:
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    converted: dict[str, Any] = {"role": role}
    if calls:
        converted["tool_calls"] = calls
    if parts:
        converted["content"] = _joined(parts)
        out.append(converted)
    elif calls:
        out.append(converted)
    elif role != "user":
        converted["content"] = ""
        out.append(converted)


def _joined(parts: list[dict]) -> str | list[dict]:
    return parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else list(parts)


def _tools(body: dict, chat: dict) -> None:
    """Custom tools become functions; Anthropic's server tools are skipped; tool_choice."""
    tools = []
    for tool in body.get("tools") or ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind and kind.startswith(SERVER_TOOL_PREFIXES):
            continue
        schema = dict(tool.get("input_schema") or {})
        schema.setdefault("type", "object")
        tools.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description") or "",
            "parameters": schema, "strict": bool(tool.get("strict", False))}})
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "none":
            chat["tool_choice"] = "none"
        elif tools:
            names = [t["function"]["name"] for t in tools]
            if kind == "tool" and choice.get("name") not in names:
                raise ValueError(f"tool_choice references tool {choice.get('name')!r} but it "
                                 "is not in the forwarded tools list")
            chat["tool_choice"] = {"auto": "auto", "any": "required"}.get(kind) or {
                "type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("any", "tool"):
            raise ValueError(f"tool_choice={kind!r} requires at least one custom tool")
    elif tools:
        chat["tool_choice"] = "auto"


def to_chat(body: dict) -> dict:
    """The chat request an Anthropic request becomes (PD routing fields included)."""
    messages: list[dict] = []
    system = body.get("system")
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    elif isinstance(system, list):
        texts = [b["text"] for b in system if isinstance(b, dict) and b.get("type") == "text"
                 and b.get("text")]
        if texts:
            messages.append({"role": "system", "content": "\n".join(texts)})
    for msg in body["messages"]:
        if isinstance(msg["content"], str):
            messages.append({"role": msg["role"], "content": msg["content"]})
        else:
            _blocks(msg, messages)
    chat: dict[str, Any] = {"messages": messages, "model": body.get("model"),
                            "max_tokens": body.get("max_tokens", 1),
                            "stream": bool(body.get("stream"))}
    chat.update({k: body[k] for k in PD_ROUTING if body.get(k) is not None})
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    _tools(body, chat)
    return chat


# -- answers ----------------------------------------------------------------------------------

def _event(payload: dict) -> bytes:
    """`_wrap_sse_event`: the event's type line, then its data."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _usage(job: Job, cache_report: bool, output: int | None) -> dict[str, int]:
    """`_anthropic_usage_from_openai`: input tokens are the uncached part of the prompt."""
    figures = usage([job], 1, cache_report)
    cached = (figures.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    out = {"input_tokens": max(figures["prompt_tokens"] - cached, 0)}
    out["output_tokens"] = figures["completion_tokens"] if output is None else output
    if cached:
        out["cache_read_input_tokens"] = cached
    return out


def _stop_reason(job: Job) -> str:
    reason = (job.finish_reason or {}).get("type") or "stop"
    return STOP_REASON_MAP.get(reason, "end_turn")


class AnthropicFormatter:
    """One item's Anthropic answer: `_generate_anthropic_stream` for a stream (message_start
    once the first chunk is out, one text block, message_delta with the stop reason and the
    output tokens, message_stop; no [DONE]), `_convert_response` for a whole answer."""

    defer_headers = True

    def __init__(self, body: dict, mode: str, cache_report: bool) -> None:
        self.model = str(body.get("model"))
        self.mode, self.cache_report = mode, cache_report
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._started = self._open = self._closed = False
        self._sent = self._offset = 0

    def closed(self, job: Job) -> bool:
        return self._closed

    def updates(self, job: Job) -> list[bytes]:
        if self._closed or job.cancelled:
            self._closed = True
            return []
        if job.error is not None:  # _flush_on_error, after _parse_upstream_error
            self._closed = True
            kind = ERROR_TYPE_MAP.get(job.error.status, "api_error")
            return [*self._start(job), *self._close_block(),
                    _event({"type": "error", "error": {"type": kind,
                                                       "message": job.error.message}}),
                    _event({"type": "message_stop"})]
        if (self.mode == "prefill" and not job.done) or (
                not job.done and len(job.output_ids) == self._sent):
            return []
        self._sent = len(job.output_ids)
        out = self._start(job)
        delta, self._offset = job.text[self._offset:], len(job.text)
        if delta:
            if not self._open:
                self._open = True
                out.append(_event({"type": "content_block_start", "index": 0,
                                   "content_block": {"type": "text", "text": ""}}))
            out.append(_event({"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": delta}}))
        if job.done:
            self._closed = True
            out += self._close_block()
            out.append(_event({"type": "message_delta",
                               "delta": {"stop_reason": _stop_reason(job)},
                               "usage": {"output_tokens": len(job.output_ids)}}))
            out.append(_event({"type": "message_stop"}))
        return out

    def _start(self, job: Job) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message = {"id": self.message_id, "type": "message", "role": "assistant",
                   "content": [], "model": self.model,
                   "usage": _usage(job, self.cache_report, 0)}
        return [_event({"type": "message_start", "message": message})]

    def _close_block(self) -> list[bytes]:
        if not self._open:
            return []
        self._open = False
        return [_event({"type": "content_block_stop", "index": 0})]

    def trailer(self) -> list[bytes]:
        return []

    def unary(self, jobs: list[Job]) -> tuple[int, object]:
        job = jobs[0]
        if job.error is not None:  # _convert_openai_error_response of the chat error
            status = job.error.status
            kind = ERROR_TYPE_MAP.get(status, "api_error")
            if status < 500:  # the chat error's own type is kept for a 4xx
                kind = "BadRequestError" if status == 400 else str(status)
            return status, {"type": "error", "error": {
                "type": kind, "message": _scrub(job.error.message, status)}}
        return 200, {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                     "content": [{"type": "text", "text": job.text}], "model": self.model,
                     "stop_reason": _stop_reason(job),
                     "usage": _usage(job, self.cache_report, None)}


async def _body(request: Request, counting: bool) -> dict | JSONResponse:
    try:
        body = await read_json(request)
    except BadRequest as exc:
        return error(400, "invalid_request_error", str(exc))
    problems = validate(body, counting)
    if problems:
        return error(400, "invalid_request_error", "; ".join(problems)[:500])
    return body


async def messages(request: Request) -> ASGIApp:
    """POST /v1/messages (`anthropic_v1_messages`, `AnthropicServing.handle_messages`)."""
    state: SimState = request.app.state.sim
    state.stats.received(ENDPOINT)
    early = await faults.before_generation(state, request, ENDPOINT)
    if early is not None:
        return early
    body = await _body(request, counting=False)
    if isinstance(body, JSONResponse):
        state.stats.record(ENDPOINT, "", None, "failed", "validation")
        return body
    try:
        chat = to_chat(body)
        prompt = tokenizer.render_chat(chat["messages"])
        generate = openai_to_generate(chat, prompt, chat["max_tokens"], False, 0, -1)
        jobs, warmups = make_jobs(state, parse_generate(generate, state.config), request.scope,
                                  ENDPOINT)
    except (ValueError, BadRequest) as exc:
        state.stats.record(ENDPOINT, "", None, "failed", str(exc))
        return error(getattr(exc, "status", 400), "invalid_request_error", str(exc))
    formatter = AnthropicFormatter(body, state.config.mode, state.config.enable_cache_report)
    return cuts.shape(state, respond(state, jobs, formatter, chat["stream"], ENDPOINT, warmups),
                      ENDPOINT)


async def count_tokens(request: Request) -> JSONResponse:
    """POST /v1/messages/count_tokens (`handle_count_tokens`): the chat prompt's tokens."""
    body = await _body(request, counting=True)
    if isinstance(body, JSONResponse):
        return body
    try:
        chat = to_chat({**body, "max_tokens": 1, "stream": False})
    except ValueError as exc:
        return error(400, "invalid_request_error", str(exc))
    prompt = tokenizer.render_chat(chat["messages"])
    return JSONResponse({"input_tokens": len(tokenizer.encode(prompt))})
