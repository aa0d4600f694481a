"""The native API: POST /generate, /abort_request, /flush_cache.

Errors follow http_server.py: a 400 (bad input) is `{"error": {"message"}}`,
any other status is the HTTPException shape `{"object": "error", "message",
"type": "<status>", "param": null, "code": <status>}`. A streaming request
that fails after the stream began (every PD failure) gets HTTP 200 and a
final chunk whose `finish_reason` is `{"type": "abort", "status_code": ...}`.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from backends.sim import cuts, faults, flows
from backends.sim.job import Job
from backends.sim.outputs import native_output
from backends.sim.requests import BadRequest, InternalError, ParsedRequest, parse_generate
from backends.sim.responses import DONE, first_error, respond, send_json, send_text, sse
from backends.sim.state import SimState

ENDPOINT = "/generate"


def native_error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    if status == 400:
        return status, {"error": {"message": message}}
    return status, {"object": "error", "message": message, "type": str(status), "param": None,
                    "code": status}


class NativeFormatter:
    """Shapes of /generate: cumulative chunks, `[DONE]`, dict or list."""

    defer_headers = False

    def __init__(self, mode: str, is_single: bool) -> None:
        self.mode = mode
        self.is_single = is_single
        self._sent: dict[int, int] = {}
        self._closed: set[int] = set()

    def closed(self, job: Job) -> bool:
        return job.spec.index in self._closed

    def updates(self, job: Job) -> list[bytes]:
        idx = job.spec.index
        if idx in self._closed:
            return []
        index = None if self.is_single else idx
        if job.cancelled:
            self._closed.add(idx)
            return []
        if job.done:
            self._closed.add(idx)
            return [sse(native_output(job, self.mode, index))]
        count = len(job.output_ids)
        if self.mode == "prefill" or count == self._sent.get(idx, 0):
            return []
        self._sent[idx] = count
        return [sse(native_output(job, self.mode, index))]

    def trailer(self) -> list[bytes]:
        return [DONE]

    def unary(self, jobs: list[Job]) -> tuple[int, object]:
        failed = first_error(jobs)
        if failed is not None and failed.error is not None:
            return native_error(failed.error.status, failed.error.message)
        outs = [native_output(j, self.mode) for j in jobs]
        return 200, outs[0] if self.is_single else outs


async def read_json(request: Request) -> Any:
    return parse_json(await request.body())


def parse_json(body: bytes) -> Any:
    if not body:
        return {}
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None


def make_jobs(state: SimState, parsed: ParsedRequest, scope: Scope | None = None,
              endpoint: str = ENDPOINT) -> tuple[list[Job], list[Job]]:
    """The jobs (and n > 1 warm-ups) of one request; a rid still running is refused; with
    --enable-trace, the request's trace headers are recorded.

    mirrors TokenizerManager._init_req_state (managers/tokenizer_manager.py).
    """
    if state.config.enable_trace and scope is not None:
        state.stats.traced(endpoint, parsed.rids, scope["headers"])
    live = [rid for rid in parsed.rids if rid in state.jobs]
    if live:
        raise BadRequest(f"Duplicate request ID detected: {live[0]}")
    state.stats.priorities[str(parsed.priority)] += 1
    return [Job(spec=s) for s in parsed.items], [Job(spec=s) for s in parsed.warmups]


async def generate_asgi(state: SimState, scope: Scope, receive: Receive, send: Send) -> None:
    """POST /generate without Starlette (app.py routes here unless a fault knob is on).

    Starlette's Request, routing and middleware cost more than the rest of a
    small request; this path reads the body and answers by hand.
    """
    state.stats.received(ENDPOINT)
    state.generation_requests += 1
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return  # the client left before sending the body
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    await answer_generate(state, b"".join(chunks), scope, receive, send)


async def generate(request: Request) -> ASGIApp:
    """POST /generate through Starlette: used while a fault knob may answer first."""
    state: SimState = request.app.state.sim
    state.stats.received(ENDPOINT)
    early = await faults.before_generation(state, request, ENDPOINT)
    if early is not None:
        return early
    body = await request.body()

    async def answer(scope: Scope, receive: Receive, send: Send) -> None:
        await answer_generate(state, body, scope, receive, send)
    return cuts.shape(state, answer, ENDPOINT)


async def answer_generate(state: SimState, body: bytes, scope: Scope, receive: Receive,
                          send: Send) -> None:
    try:
        parsed = parse_generate(parse_json(body), state.config)
        jobs, warmups = make_jobs(state, parsed, scope)
    except BadRequest as exc:
        state.stats.record(ENDPOINT, "", None, "failed", str(exc))
        status, payload = native_error(getattr(exc, "status", 400), str(exc))
        await send_json(send, status, payload)
        return
    except InternalError as exc:  # an exception FastAPI answers with its bare 500
        state.stats.record(ENDPOINT, "", None, "failed", str(exc))
        await send_text(send, 500, b"Internal Server Error")
        return
    formatter = NativeFormatter(state.config.mode, parsed.is_single)
    response = respond(state, jobs, formatter, parsed.stream, ENDPOINT, warmups)
    await response(scope, receive, send)


async def abort_request(request: Request) -> Response:
    state: SimState = request.app.state.sim
    try:
        body = await read_json(request)
    except BadRequest as exc:
        status, payload = native_error(400, str(exc))
        return JSONResponse(payload, status_code=status)
    rid = body.get("rid") if isinstance(body, dict) else None
    abort_all = bool(body.get("abort_all", False)) if isinstance(body, dict) else False
    flows.abort(state, rid, abort_all)
    return Response(status_code=200)


async def flush_cache(request: Request) -> Response:
    state: SimState = request.app.state.sim
    if any(r.engine.num_running or r.engine.waiting for r in state.ranks):
        return PlainTextResponse(
            "Cache not flushed: there are running or waiting requests.\n", status_code=400)
    for rank in state.ranks:  # every scheduler flushes its own cache
        rank.cache.clear()
    state.stats.flush_count += 1
    return PlainTextResponse(
        "Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)\n")
