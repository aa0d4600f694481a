"""The ASGI responses of the generation endpoints.

Both watch the receive channel for `http.disconnect` (so a client that leaves
cancels its items, streaming or not) and write through a formatter that knows
the endpoint's JSON shapes. A non-streaming answer is the finished state.

- `SingleResponse`: one item, not streaming (every PD request of a router).
  The item's flow runs inside the request's own task, and the disconnect
  comes as a callback from our uvicorn protocol (httpproto.py): no extra task.
- `JobsResponse`: batches, `n > 1` and streams: one task per item, and a
  shared Event that wakes the writer on every token. For `n > 1` the
  warm-ups run first, one after the other; the samples start once all
  succeeded, and a failed warm-up fails the request (SGLang raises it).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Protocol

import orjson
from starlette.types import Receive, Scope, Send

from backends.sim.flows import interrupt, launch, register, run_job
from backends.sim.httpproto import DISCONNECT_SCOPE_KEY
from backends.sim.job import Job
from backends.sim.state import SimState

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"


def sse(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class Formatter(Protocol):
    """Endpoint-specific shapes of progress, end of stream and final answer."""

    defer_headers: bool

    def updates(self, job: Job) -> list[bytes]: ...

    def closed(self, job: Job) -> bool: ...

    def trailer(self) -> list[bytes]: ...

    def unary(self, jobs: list[Job]) -> tuple[int, object]: ...


def respond(state: SimState, jobs: list[Job], formatter: Formatter, stream: bool,
            endpoint: str, warmups: list[Job] | None = None) -> SingleResponse | JobsResponse:
    if len(jobs) == 1 and not stream and not warmups:
        return SingleResponse(state, jobs[0], formatter, endpoint)
    return JobsResponse(state, jobs, formatter, stream, endpoint, warmups or [])


class SingleResponse:
    """Serve one non-streaming item in this task and answer with its final state."""

    def __init__(self, state: SimState, job: Job, formatter: Formatter, endpoint: str) -> None:
        self.state, self.job, self.formatter, self.endpoint = state, job, formatter, endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        job = self.job
        register(self.state, job, asyncio.current_task())
        connection = scope.get(DISCONNECT_SCOPE_KEY)
        on_disconnect = functools.partial(interrupt, job)
        watcher = None
        if connection is not None:  # our uvicorn protocol calls back: no watcher task
            connection.on_disconnect.add(on_disconnect)
        else:
            watcher = asyncio.get_running_loop().create_task(_watch(receive, job))
        try:
            await run_job(self.state, job, self.endpoint)
        finally:
            if connection is not None:
                connection.on_disconnect.discard(on_disconnect)
            if watcher is not None:
                watcher.cancel()
        if job.cancelled:
            return  # the client is gone
        status, payload = self.formatter.unary([job])
        await send_json(send, status, payload)


async def _watch(receive: Receive, job: Job) -> None:
    """Cancel the item's flow when the client disconnects before the answer."""
    while (await receive())["type"] != "http.disconnect":
        pass
    interrupt(job)


class JobsResponse:
    """Serve `jobs` (one task each, one shared `changed` event) and answer the client."""

    def __init__(self, state: SimState, jobs: list[Job], formatter: Formatter, stream: bool,
                 endpoint: str, warmups: list[Job]) -> None:
        self.state, self.jobs, self.formatter = state, jobs, formatter
        self.stream, self.endpoint, self.warmups = stream, endpoint, warmups
        self.changed = asyncio.Event()
        for job in (*warmups, *jobs):
            job.changed = self.changed
        self.disconnected = False
        self.started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        tasks: list[asyncio.Task[None]] = []
        answered = False
        try:
            if self.stream and not self.formatter.defer_headers:
                await self._start(send)  # StreamingResponse sends its head before the warm-ups
            if not await self._warm_up(send, tasks):
                return
            tasks += [launch(self.state, job, self.endpoint) for job in self.jobs]
            answered = await (self._stream(send) if self.stream else self._unary(send))
        finally:
            watcher.cancel()
            if not answered:  # client gone (or server stopping): cancel what still runs
                for task in tasks:
                    task.cancel()

    async def _start(self, send: Send) -> None:
        if not self.started:
            self.started = True
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def _warm_up(self, send: Send, tasks: list[asyncio.Task[None]]) -> bool:
        """Run the n > 1 warm-ups in order; False if the request ended with them.

        mirrors TokenizerManager._handle_batch_request (managers/tokenizer_manager.py): each
        warm-up is sent and awaited before the next; a failed one raises out of
        generate_request, which is a JSON error answer, or, once a native stream has sent
        its head, an exception that breaks the connection (nothing else catches it).
        """
        for job in self.warmups:
            task = launch(self.state, job, self.endpoint)
            tasks.append(task)
            while True:
                self.changed.clear()
                if job.done or self.disconnected:
                    break
                await self.changed.wait()
            if self.disconnected:
                return False
            if job.error is not None:
                if self.started:
                    raise RuntimeError(f"n > 1 warm-up failed: {job.error.message}")
                status, payload = self.formatter.unary([job])
                await send_json(send, status, payload)
                return False
        return True

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                self.changed.set()
                return

    async def _stream(self, send: Send) -> bool:
        """Write the SSE stream; False if the client left before the end."""
        if not self.formatter.defer_headers:
            await self._start(send)
        while True:
            self.changed.clear()
            for job in self.jobs:
                for chunk in self.formatter.updates(job):
                    await self._start(send)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if self.disconnected:
                return False
            if all(self.formatter.closed(job) for job in self.jobs):
                break
            await self.changed.wait()
        await self._start(send)
        body = b"".join(self.formatter.trailer())
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return True

    async def _unary(self, send: Send) -> bool:
        """Answer once every item ended (or one failed); False if the client left first."""
        while True:
            self.changed.clear()
            if self.disconnected:
                return False
            if any(j.error for j in self.jobs) or all(j.done for j in self.jobs):
                break
            await self.changed.wait()
        status, payload = self.formatter.unary(self.jobs)
        await send_json(send, status, payload)
        return True


async def send_json(send: Send, status: int, payload: object) -> None:
    """One JSON answer with a Content-Length (uvicorn would chunk it otherwise)."""
    body = orjson.dumps(payload)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_text(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"),
               (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def first_error(jobs: list[Job]) -> Job | None:
    """The job whose error answers a non-streaming request (earliest to fail)."""
    failed = [j for j in jobs if j.error is not None]
    return min(failed, key=lambda j: j.finished_at or 0.0) if failed else None
