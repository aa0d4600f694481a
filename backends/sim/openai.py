"""OpenAI-compatible endpoints: /v1/completions and /v1/chat/completions.

Shapes follow SGLang's serving_completions.py / serving_chat.py / sse_utils.py:
errors are `{"object": "error", "message", "type", "param", "code"}`; a failure
after a stream began is an SSE `{"error": {...}}` event and ends the stream;
`stream_options.include_usage` adds a final chunk with empty `choices`.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from backends.sim import cuts, faults, tokenizer
from backends.sim.job import Job, SimError
from backends.sim.native import make_jobs, read_json
from backends.sim.outputs import input_logprobs, output_logprobs, output_top_logprobs, usage
from backends.sim.requests import BadRequest, InternalError, openai_to_generate, parse_generate
from backends.sim.responses import DONE, first_error, respond, sse
from backends.sim.state import SimState


def openai_error(status: int, message: str, err_type: str | None = None) -> dict[str, Any]:
    kind = err_type or ("BadRequestError" if status == 400 else str(status))
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def _stream_error(error: SimError) -> bytes:
    """The SSE error event (create_streaming_error_response, type = HTTPStatus name)."""
    kind = {400: "BAD_REQUEST", 500: "INTERNAL_SERVER_ERROR", 503: "SERVICE_UNAVAILABLE"}
    err = openai_error(error.status, error.message, kind.get(error.status, "ERROR"))
    return sse({"error": err})


def _completion_logprobs(triples: list[list[Any]], tops: list[list[list[Any]]] | None) -> dict:
    return {
        "text_offset": [-1] * len(triples),
        "token_logprobs": [t[0] for t in triples],
        "tokens": [tokenizer.token_text(t[1]) for t in triples],
        "top_logprobs": [{tokenizer.token_text(x[1]): x[0] for x in top} for top in (tops or [])],
    }


def _chat_logprobs(job: Job, start: int) -> dict:
    tops = output_top_logprobs(job, start) if job.spec.top_logprobs_num else None
    content = []
    for i, (lp, tok, _) in enumerate(output_logprobs(job, start)):
        text = tokenizer.token_text(tok)
        top = [{"token": tokenizer.token_text(x[1]), "bytes": list(tokenizer.token_bytes(x[1])),
                "logprob": x[0]} for x in (tops[i] if tops else [])]
        content.append({"token": text, "bytes": list(tokenizer.token_bytes(tok)), "logprob": lp,
                        "top_logprobs": top})
    return {"content": content}


class _OpenAIFormatter:
    """Shared bookkeeping: per-choice text offset, error ends the stream."""

    defer_headers = True
    chat = False

    def __init__(self, body: dict[str, Any], mode: str, n: int, cache_report: bool,
                 echo_texts: list[str], want_logprobs: bool) -> None:
        self.model = str(body.get("model", "default"))
        self.created = int(time.time())
        self.mode, self.n, self.cache_report = mode, n, cache_report
        self.echo_texts, self.want_logprobs = echo_texts, want_logprobs
        opts = body.get("stream_options") or {}
        self.include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        self._sent: dict[int, int] = {}
        self._offsets: dict[int, int] = {}
        self._closed: set[int] = set()
        self._errored = False
        self._jobs: list[Job] = []

    def closed(self, job: Job) -> bool:
        return self._errored or job.spec.index in self._closed

    def updates(self, job: Job) -> list[bytes]:
        idx = job.spec.index
        if self.closed(job):
            return []
        if job not in self._jobs:
            self._jobs.append(job)
        if job.cancelled:
            self._closed.add(idx)
            return []
        if job.error is not None:
            self._errored = True
            return [_stream_error(job.error)]
        if self.mode == "prefill" and not job.done:
            return []
        count = len(job.output_ids)
        if not job.done and count == self._sent.get(idx, 0):
            return []
        first = idx not in self._sent
        start = max(self._sent.get(idx, 0), 0)
        self._sent[idx] = count
        if job.done:
            self._closed.add(idx)
        return self.chunks(job, first, start)

    def chunks(self, job: Job, first: bool, start: int) -> list[bytes]:
        raise NotImplementedError

    def _base(self, job: Job, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": job.spec.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def trailer(self) -> list[bytes]:
        out = []
        if self.include_usage and self._jobs and not self._errored:
            jobs = sorted(self._jobs, key=lambda j: j.spec.index)
            chunk = self._base(jobs[0], [])
            chunk["usage"] = usage(jobs, self.n, self.cache_report)
            if not self.chat:
                chunk["usage"] = {k: v for k, v in chunk["usage"].items() if v is not None}
            out.append(sse(chunk))
        out.append(DONE)
        return out

    def _text_delta(self, job: Job) -> str:
        """New text of a choice since its last chunk (chunks carry deltas)."""
        offset = self._offsets.get(job.spec.index, 0)
        self._offsets[job.spec.index] = len(job.text)
        return job.text[offset:]

    def unary(self, jobs: list[Job]) -> tuple[int, object]:
        failed = first_error(jobs)
        if failed is not None and failed.error is not None:
            return failed.error.status, openai_error(failed.error.status, failed.error.message)
        choices = [self.choice(j) for j in jobs]
        obj = "chat.completion" if self.chat else "text_completion"
        return 200, {"id": jobs[0].spec.rid, "object": obj, "created": self.created,
                     "model": self.model, "choices": choices,
                     "usage": usage(jobs, self.n, self.cache_report),
                     "metadata": {"weight_version": "default"}}

    def choice(self, job: Job) -> dict[str, Any]:
        raise NotImplementedError


def _finish(job: Job) -> tuple[str | None, Any]:
    fr = job.finish_reason
    return (fr["type"], fr.get("matched")) if fr else (None, None)


class CompletionsFormatter(_OpenAIFormatter):
    def _logprobs(self, job: Job, start: int, with_input: bool) -> dict | None:
        if not self.want_logprobs:
            return None
        triples = output_logprobs(job, start)
        tops = output_top_logprobs(job, start) if job.spec.top_logprobs_num else []
        if with_input:
            triples = input_logprobs(job, self.mode) + triples
        return _completion_logprobs(triples, tops)

    def chunks(self, job: Job, first: bool, start: int) -> list[bytes]:
        delta = self._text_delta(job)
        echo = self.echo_texts[job.spec.index // self.n] if first and self.echo_texts else ""
        reason, matched = _finish(job)
        lp = self._logprobs(job, start, with_input=first and bool(self.echo_texts))
        choice = {"index": job.spec.index, "text": echo + delta, "logprobs": lp,
                  "finish_reason": reason, "matched_stop": matched}
        return [sse({**self._base(job, [choice]), "usage": None})]

    def choice(self, job: Job) -> dict[str, Any]:
        echo = self.echo_texts[job.spec.index // self.n] if self.echo_texts else ""
        reason, matched = _finish(job)
        return {"index": job.spec.index, "text": echo + job.text,
                "logprobs": self._logprobs(job, 0, with_input=bool(self.echo_texts)),
                "finish_reason": reason, "matched_stop": matched}


class ChatFormatter(_OpenAIFormatter):
    chat = True

    def _chunk(self, job: Job, delta: dict[str, Any], logprobs: Any = None,
               reason: str | None = None, matched: Any = None) -> bytes:
        choice = {"index": job.spec.index, "delta": {"reasoning_content": None, **delta},
                  "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
        return sse(self._base(job, [choice]))

    def chunks(self, job: Job, first: bool, start: int) -> list[bytes]:
        out = []
        if first:
            out.append(self._chunk(job, {"role": "assistant", "content": ""}))
        delta = self._text_delta(job)
        if delta:
            lp = _chat_logprobs(job, start) if self.want_logprobs else None
            out.append(self._chunk(job, {"content": delta}, lp))
        if job.done:
            reason, matched = _finish(job)
            out.append(self._chunk(job, {}, None, reason, matched))
        return out

    def choice(self, job: Job) -> dict[str, Any]:
        reason, matched = _finish(job)
        return {"index": job.spec.index,
                "message": {"role": "assistant", "content": job.text, "reasoning_content": None},
                "logprobs": _chat_logprobs(job, 0) if self.want_logprobs else None,
                "finish_reason": reason, "matched_stop": matched}


async def _serve(request: Request, endpoint: str, chat: bool) -> ASGIApp:
    state: SimState = request.app.state.sim
    state.stats.received(endpoint)
    early = await faults.before_generation(state, request, endpoint)
    if early is not None:
        return early
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("The request body should be a JSON object.")
        formatter, generate_body = (_chat if chat else _completion)(body, state)
        header = request.headers.get("x-data-parallel-rank")
        if header is not None:
            rank = _header_rank(header)
            if isinstance(rank, JSONResponse):
                return rank
            generate_body["routed_dp_rank"] = rank
        parsed = parse_generate(generate_body, state.config)
        jobs, warmups = make_jobs(state, parsed, request.scope, endpoint)
    except BadRequest as exc:
        state.stats.record(endpoint, "", None, "failed", str(exc))
        status = getattr(exc, "status", 400)
        return JSONResponse(openai_error(status, str(exc)), status_code=status)
    except InternalError as exc:  # OpenAIServingBase.handle_request's catch-all
        state.stats.record(endpoint, "", None, "failed", str(exc))
        return JSONResponse(openai_error(500, f"Internal server error: {exc}",
                                         "InternalServerError"), status_code=500)
    return cuts.shape(state, respond(state, jobs, formatter, parsed.stream, endpoint, warmups),
                      endpoint)


def _header_rank(value: str) -> int | JSONResponse:
    """X-Data-Parallel-Rank overrides the body's routed_dp_rank; mirrors
    OpenAIServingBase.extract_routed_dp_rank_from_header (entrypoints/openai/serving_base.py)."""
    try:
        return int(value)
    except ValueError:
        message = f"Invalid X-Data-Parallel-Rank header: must be an integer, got '{value}'"
        return JSONResponse(openai_error(400, message, "400"), status_code=400)


def _completion(body: dict[str, Any], state: SimState) -> tuple[_OpenAIFormatter, dict[str, Any]]:
    prompt = body.get("prompt")
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
        raise BadRequest("Prompt cannot be empty")
    logprobs = body.get("logprobs")
    echo = bool(body.get("echo"))
    start = 0 if echo and logprobs else -1
    generate_body = openai_to_generate(body, prompt, body.get("max_tokens", 16), logprobs is not None,
                                       int(logprobs or 0), start)
    if isinstance(prompt, str):
        echo_texts = [prompt]
    elif isinstance(prompt[0], str):
        echo_texts = list(prompt)
    elif isinstance(prompt[0], int):
        echo_texts = [tokenizer.decode(prompt)]
    else:
        echo_texts = [tokenizer.decode(p) for p in prompt]
    formatter = CompletionsFormatter(body, state.config.mode, int(body.get("n", 1) or 1),
                                     state.config.enable_cache_report,
                                     echo_texts if echo else [], logprobs is not None)
    return formatter, generate_body


def _chat(body: dict[str, Any], state: SimState) -> tuple[_OpenAIFormatter, dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages should be a non-empty list")
    prompt = tokenizer.render_chat(messages, bool(body.get("continue_final_message")))
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    want = bool(body.get("logprobs"))
    top = int(body.get("top_logprobs") or 0) if want else 0
    generate_body = openai_to_generate(body, prompt, max_tokens, want, top, -1)
    formatter = ChatFormatter(body, state.config.mode, int(body.get("n", 1) or 1),
                              state.config.enable_cache_report, [], want)
    return formatter, generate_body


async def completions(request: Request) -> ASGIApp:
    return await _serve(request, "/v1/completions", chat=False)


async def chat_completions(request: Request) -> ASGIApp:
    return await _serve(request, "/v1/chat/completions", chat=True)
