"""POST /v1/responses: SGLang's Responses API shapes over the sim's generation.

Rules, each after the SGLang 0.5.23 function it mirrors
(sglang/srt/entrypoints/openai/serving_responses.py unless named otherwise):

* `previous_response_id` or `background` on a server without `--enable-response-store` (never
  with PD: `arg_groups/validation_hook.py` refuses the pair) is a 400 naming the field
  (`create_responses`, `_response_store_disabled_error`); `store` alone is accepted and
  nothing is kept.
* The prompt: `instructions` as a system message, then each input item as a chat message
  (`_construct_input_messages`, `_response_input_history`: a string input is one user
  message; text parts of any type joined), through the chat template.
* The engine request's rid is `request_id` (`GenerateReqInput(rid=request.request_id)`), so
  `/abort_request` by that rid aborts it; the response id is the same (`ResponsesResponse.
  from_request`); PD fields go to the engine as for chat.
* `max_output_tokens` is the token budget (`ResponsesRequest.to_sampling_params`).
* A whole answer is the `response` object (`responses_full_generator`): status from the
  finish reason (`_status_from_finish_reason`: length -> incomplete, abort -> failed), usage
  in the Responses shape (`ResponsesResponse._serialize_usage`).
* A stream (`_responses_stream_generator_non_harmony`) is `event: <type>` + `data:` events
  with a `sequence_number`: response.created, response.in_progress, then for the message
  response.output_item.added, response.content_part.added, response.output_text.delta per
  update, response.output_text.done, response.content_part.done, response.output_item.done,
  and last `response.<status>` with the whole response; no `[DONE]`.
* Errors are `{"error": {message, type, param, code}}` (`create_error_response`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from backends.sim import cuts, faults, tokenizer
from backends.sim.job import Job
from backends.sim.native import make_jobs, read_json
from backends.sim.requests import BadRequest, openai_to_generate, parse_generate
from backends.sim.responses import respond
from backends.sim.state import SimState

ENDPOINT = "/v1/responses"
STORE_DISABLED = ("Response store is disabled. Stateful Responses require "
                  "--enable-response-store on a standalone server; response storage "
                  "is unavailable in PD mode.")


def error(message: str, status: int = 400, param: str | None = None,
          kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def messages_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """mirrors _construct_input_messages (no tools: every item a role message)."""
    messages = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    value = body.get("input")
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise BadRequest("input should be a string or a list of items")
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("role"), str):
            messages.append({"role": item["role"], "content": _text(item.get("content"))})
    return messages


class ResponsesFormatter:
    """The response object and its stream events for one item."""

    defer_headers = True

    def __init__(self, body: dict[str, Any], rid: str, mode: str, cache_report: bool) -> None:
        self.body, self.rid, self.mode, self.cache_report = body, rid, mode, cache_report
        self.created = int(time.time())
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.seq = 0
        self.sent = -1  # characters of text streamed; -1: nothing yet
        self.closed_ = False
        self.job: Job | None = None

    def response(self, job: Job | None, status: str) -> dict[str, Any]:
        output = []
        if job is not None and status != "in_progress":
            output = [self._message(job.text)]
        return {"id": self.rid, "object": "response", "created_at": self.created,
                "model": str(self.body.get("model") or "default"), "output": output,
                "status": status, "usage": self._usage(job) if status != "in_progress" else None,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "error": None, "incomplete_details": None,
                "instructions": self.body.get("instructions"),
                "max_output_tokens": self.body.get("max_output_tokens"),
                "previous_response_id": None, "store": self.body.get("store", True),
                "temperature": self.body.get("temperature"), "text": None, "top_p": None,
                "truncation": "disabled", "user": None, "metadata": self.body.get("metadata")}

    def _message(self, text: str) -> dict[str, Any]:
        return {"id": self.msg_id, "type": "message", "role": "assistant", "status": "completed",
                "content": [self._part(text)], "phase": "final_answer"}

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}

    def _usage(self, job: Job | None) -> dict[str, Any] | None:
        if job is None:
            return None
        prompt, completion = job.prompt_tokens, len(job.output_ids)
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": job.cached_tokens
                                         if self.cache_report else 0, "cache_write_tokens": 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion}

    @staticmethod
    def status(job: Job) -> str:
        """mirrors _status_from_finish_reason."""
        kind = (job.finish_reason or {}).get("type")
        return "incomplete" if kind == "length" else "failed" if kind in ("abort", "error") \
            else "completed"

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def closed(self, job: Job) -> bool:
        return self.closed_

    def updates(self, job: Job) -> list[bytes]:
        if self.closed_ or job.cancelled:
            self.closed_ = self.closed_ or job.cancelled
            return []
        out = []
        if self.sent < 0:
            self.sent = 0
            head = self.response(None, "in_progress")
            out += [self._event("response.created", response=head),
                    self._event("response.in_progress", response=head)]
        if job.error is not None:
            failed = self.response(None, "failed")
            failed["error"] = {"code": "server_error", "message": job.error.message}
            self.closed_ = True
            return out + [self._event("response.failed", response=failed)]
        if self.mode == "prefill" and not job.done:
            return out
        out += self._deltas(job)
        if job.done:
            out += self._close(job)
        return out

    def _deltas(self, job: Job) -> list[bytes]:
        out = []
        if self.sent == 0 and (job.text or job.done):
            item = {"id": self.msg_id, "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            out += [self._event("response.output_item.added", output_index=0, item=item),
                    self._event("response.content_part.added", item_id=self.msg_id,
                                output_index=0, content_index=0, part=self._part(""))]
        delta = job.text[self.sent:] if len(job.text) > self.sent else ""
        if delta:
            out.append(self._event("response.output_text.delta", item_id=self.msg_id,
                                   output_index=0, content_index=0, delta=delta, logprobs=[]))
            self.sent = len(job.text)
        return out

    def _close(self, job: Job) -> list[bytes]:
        self.closed_ = True
        text = job.text
        return [self._event("response.output_text.done", item_id=self.msg_id, output_index=0,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self.msg_id, output_index=0,
                            content_index=0, part=self._part(text)),
                self._event("response.output_item.done", output_index=0,
                            item=self._message(text)),
                self._event(f"response.{self.status(job)}",
                            response=self.response(job, self.status(job)))]

    def trailer(self) -> list[bytes]:
        return []

    def unary(self, jobs: list[Job]) -> tuple[int, object]:
        job = jobs[0]
        if job.error is not None:
            return job.error.status, {"error": {"message": job.error.message,
                                                "type": "invalid_request_error", "param": None,
                                                "code": job.error.status}}
        return 200, self.response(job, self.status(job))


async def responses(request: Request) -> ASGIApp:
    state: SimState = request.app.state.sim
    state.stats.received(ENDPOINT)
    early = await faults.before_generation(state, request, ENDPOINT)
    if early is not None:
        return early
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("The request body should be a JSON object.")
        for name in ("previous_response_id", "background"):
            if body.get(name):
                return error(STORE_DISABLED, param=name)
        rid = body.get("request_id") or f"resp_{uuid.uuid4().hex}"
        prompt = tokenizer.render_chat(messages_of(body))
        generate_body = openai_to_generate(body, prompt, body.get("max_output_tokens"), False, 0,
                                           -1)
        generate_body["rid"] = rid
        parsed = parse_generate(generate_body, state.config)
        jobs, _ = make_jobs(state, parsed, request.scope, ENDPOINT)
    except BadRequest as exc:
        state.stats.record(ENDPOINT, "", None, "failed", str(exc))
        return error(str(exc), getattr(exc, "status", 400))
    formatter = ResponsesFormatter(body, rid, state.config.mode,
                                   state.config.enable_cache_report)
    return cuts.shape(state, respond(state, jobs, formatter, parsed.stream, ENDPOINT), ENDPOINT)
