"""Two-leg PD dispatch on one (prefill, decode) pair: one attempt, no retries here.

Both legs are sent at once with the same body (plus bootstrap fields). The first failure of
either leg cancels the other at once (closing its connection, and asking the server to abort
by request id), so a dead prefill never leaves a decode waiting minutes for KV. Non-streaming
answers are read whole; streams are relayed byte for byte, and the attempt only "succeeds"
once the decode produced its first chunk, so a retry can still happen before the client has
seen anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import orjson

from gateway.bootstrap import RoomAllocator
from gateway.errors import UpstreamError
from gateway.logprobs import StreamMerger, merge_body, prefill_parts
from gateway.request import RequestView
from gateway.sse import DONE, EventSplitter, event_data, frame
from gateway.upstream import status_error, translate_errors
from gateway.workers import Worker

JSON_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
Opened = tuple[httpx.Response, AsyncIterator[bytes]]  # a decode stream and its chunk iterator


@dataclass(frozen=True)
class Timeouts:
    response: float  # non-streaming answer, or a stream's first chunk
    stream_idle: float  # gap between two streamed chunks
    tail: float = 30.0  # how long a prefill answer may trail a finished decode


@dataclass
class Attempt:
    """One dispatch on a pair, with its rooms; `outcome` records what each leg did."""

    view: RequestView
    prefill: Worker
    decode: Worker
    rooms: int | list[int]
    rid: str | None
    payload: bytes
    headers: dict[str, str]
    outcome: dict[str, bool | None] = field(default_factory=dict)


@dataclass
class Answer:
    """The decode's answer: a whole body, or a first chunk plus the rest of the stream."""

    status: int
    content_type: str
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], Awaitable[None]] | None = None  # always awaited by the responder


class PDDispatcher:
    def __init__(self, client: httpx.AsyncClient, rooms: RoomAllocator, timeouts: Timeouts,
                 on_leg_done: Callable[[Attempt, str, bool | None], None] | None = None,
                 on_prefill_body: Callable[[Attempt, bytes], None] | None = None) -> None:
        self.client = client
        self.rooms = rooms
        self.timeouts = timeouts
        self.on_leg_done = on_leg_done or (lambda attempt, leg, ok: None)
        self.on_prefill_body = on_prefill_body or (lambda attempt, body: None)
        self._background: set[asyncio.Task] = set()

    # -- building the attempt -------------------------------------------------------------

    def prepare(self, view: RequestView, prefill: Worker, decode: Worker,
                request_id: str) -> Attempt:
        """New rooms (never reused, also not on retry) and the body both legs receive."""
        count = view.room_count
        rooms = self.rooms.take(count)
        body = dict(view.body)
        if prefill.bootstrap_port is None:
            raise UpstreamError(f"prefill server {prefill.url} has no known bootstrap port",
                                leg="prefill", worker_url=prefill.url, retryable=True)
        if count is None:
            body["bootstrap_host"] = prefill.bootstrap_host
            body["bootstrap_port"] = prefill.bootstrap_port
        else:
            body["bootstrap_host"] = [prefill.bootstrap_host] * count
            body["bootstrap_port"] = [prefill.bootstrap_port] * count
        body["bootstrap_room"] = rooms
        rid = body.get("rid")
        if rid is None and count is None:
            rid = body["rid"] = uuid.uuid4().hex
        headers = {**JSON_HEADERS, "x-request-id": request_id}
        return Attempt(view, prefill, decode, rooms, rid if isinstance(rid, str) else None,
                       orjson.dumps(body), headers)

    # -- one attempt -----------------------------------------------------------------------

    async def run(self, attempt: Attempt) -> Answer:
        """Send both legs; return the decode answer or raise the first leg failure."""
        loop = asyncio.get_running_loop()
        p_task = loop.create_task(self._prefill_leg(attempt))
        d_task = loop.create_task(self._decode_leg(attempt))
        handed_over = False
        try:
            async with asyncio.timeout(self.timeouts.response):
                await _first_failure(p_task, d_task)
                answer, opened = d_task.result()
                merger = None
                if attempt.view.logprob_merge:
                    parts = prefill_parts(attempt.view.endpoint, await p_task)
                    if opened is None:
                        answer.body = merge_body(attempt.view.endpoint, answer.body, parts)
                    else:
                        merger = StreamMerger(attempt.view.endpoint, parts)
            if opened is not None:
                response, chunks = opened
                stream = self._relay(attempt, response, chunks, answer.body, merger, p_task)
                answer.stream, answer.body, handed_over = stream, b"", True

                async def close() -> None:
                    await stream.aclose()
                    await self._end_stream(attempt, response, p_task, None)

                answer.close = close
            return answer
        except TimeoutError:
            leg = "decode" if p_task.done() else "prefill"
            worker = attempt.decode if leg == "decode" else attempt.prefill
            raise UpstreamError(
                f"{leg} server {worker.url} gave no answer within {self.timeouts.response:g}s",
                leg=leg, worker_url=worker.url, retryable=True, status=504) from None
        finally:
            if not handed_over:
                self._settle(attempt, p_task, d_task)

    def _settle(self, attempt: Attempt, p_task: asyncio.Task, d_task: asyncio.Task) -> None:
        """Cancel what still runs; a finished decode may leave the prefill to finish alone."""
        if not d_task.done():
            d_task.cancel()
            self._abort(attempt.decode, attempt.rid)
        elif not d_task.cancelled() and d_task.exception() is None:
            _, opened = d_task.result()
            if opened is not None:  # opened but never handed to a relay
                self._spawn(opened[0].aclose())
                self._leg_done(attempt, "decode", None)
        if not p_task.done():
            if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
                self._spawn(self._finish_tail(attempt, p_task))
            else:
                p_task.cancel()
                self._abort(attempt.prefill, attempt.rid)

    async def _finish_tail(self, attempt: Attempt, p_task: asyncio.Task) -> None:
        """The decode is done; give the prefill's own answer a bounded time to arrive."""
        try:
            async with asyncio.timeout(self.timeouts.tail):
                await asyncio.shield(p_task)
        except (TimeoutError, UpstreamError):
            pass
        finally:
            if not p_task.done():
                p_task.cancel()
                self._abort(attempt.prefill, attempt.rid)

    # -- the legs ----------------------------------------------------------------------------

    async def _open(self, attempt: Attempt, leg: str, worker: Worker) -> httpx.Response:
        request = self.client.build_request(
            "POST", worker.url + attempt.view.path, content=attempt.payload,
            headers=attempt.headers)
        with translate_errors(leg, worker):
            response = await self.client.send(request, stream=True)
            if response.status_code >= 400:
                try:
                    body = await response.aread()
                finally:
                    await response.aclose()
                raise status_error(leg, worker, response.status_code, body)
        return response

    async def _prefill_leg(self, attempt: Attempt) -> bytes:
        ok: bool | None = None
        try:
            response = await self._open(attempt, "prefill", attempt.prefill)
            try:
                with translate_errors("prefill", attempt.prefill):
                    body = await response.aread()
            finally:
                await response.aclose()
            ok = True
            self.on_prefill_body(attempt, body)
            return body
        except UpstreamError as exc:
            ok = False if exc.retryable else None
            raise
        finally:
            self._leg_done(attempt, "prefill", ok)

    async def _decode_leg(self, attempt: Attempt) -> tuple[Answer, Opened | None]:
        """Non-streaming: the whole body. Streaming: the open response and its first chunk."""
        ok: bool | None = None
        response = None
        handed = False
        try:
            response = await self._open(attempt, "decode", attempt.decode)
            content_type = response.headers.get("content-type", "application/json")
            with translate_errors("decode", attempt.decode):
                if not attempt.view.stream:
                    body = await response.aread()
                    await response.aclose()
                    ok = True
                    return Answer(response.status_code, content_type, body), None
                chunks = response.aiter_raw()
                first = b""
                async for chunk in chunks:
                    if chunk:
                        first = chunk
                        break
            if not first:
                raise UpstreamError(f"decode server {attempt.decode.url} closed the stream "
                                    "before sending anything", leg="decode",
                                    worker_url=attempt.decode.url, retryable=True)
            handed = True
            return Answer(response.status_code, content_type, first), (response, chunks)
        except BaseException as exc:
            if response is not None:
                await _close_quietly(response)
            if isinstance(exc, UpstreamError):
                ok = False if exc.retryable else None
            raise
        finally:
            if not handed:
                self._leg_done(attempt, "decode", ok)

    def _leg_done(self, attempt: Attempt, leg: str, ok: bool | None) -> None:
        if leg in attempt.outcome:
            return
        attempt.outcome[leg] = ok
        self.on_leg_done(attempt, leg, ok)

    # -- streaming relay -----------------------------------------------------------------------

    async def _relay(self, attempt: Attempt, response: httpx.Response,
                     chunks: AsyncIterator[bytes], first: bytes, merger: StreamMerger | None,
                     p_task: asyncio.Task) -> AsyncIterator[bytes]:
        """Yield the decode's SSE bytes; a mid-stream failure ends with an error event."""
        ok: bool | None = None
        splitter = EventSplitter() if merger else None
        tail = b""
        try:
            chunk: bytes | None = first
            while chunk is not None:
                out = _merge_events(splitter, merger, chunk) if splitter else chunk
                if out:
                    tail = (tail + out)[-16:]
                    yield out
                chunk = await self._next_chunk(attempt, chunks)
            if splitter and splitter.rest().strip():
                yield _merge_events(splitter, merger, b"\n\n")
            if not tail.endswith(DONE):
                raise UpstreamError(f"decode server {attempt.decode.url} ended the stream "
                                    "without [DONE]", leg="decode",
                                    worker_url=attempt.decode.url, retryable=False)
            ok = True
        except UpstreamError as exc:
            ok = False
            prefix = b"" if tail.endswith(b"\n\n") or not tail else b"\n\n"
            yield prefix + frame(exc.body()) + DONE
        finally:
            await self._end_stream(attempt, response, p_task, ok)

    async def _next_chunk(self, attempt: Attempt, chunks: AsyncIterator[bytes]) -> bytes | None:
        """The next raw chunk within the idle timeout; None at the end of the stream."""
        try:
            with translate_errors("decode", attempt.decode):
                async with asyncio.timeout(self.timeouts.stream_idle):
                    return await chunks.__anext__()
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise UpstreamError(
                f"decode server {attempt.decode.url} sent nothing for "
                f"{self.timeouts.stream_idle:g}s", leg="decode",
                worker_url=attempt.decode.url, retryable=True, status=504) from None

    async def _end_stream(self, attempt: Attempt, response: httpx.Response,
                          p_task: asyncio.Task, ok: bool | None) -> None:
        """Idempotent cleanup of a stream, whether it ran to the end or never started."""
        if "decode" in attempt.outcome:
            return
        await _close_quietly(response)
        self._leg_done(attempt, "decode", ok)
        if not p_task.done():
            self._spawn(self._finish_tail(attempt, p_task))
        if ok is None:  # the client went away mid-stream
            self._abort(attempt.decode, attempt.rid)

    # -- background chores ----------------------------------------------------------------------

    def _abort(self, worker: Worker, rid: str | None) -> None:
        if rid is not None:
            self._spawn(self._post_abort(worker, rid))

    async def _post_abort(self, worker: Worker, rid: str) -> None:
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            async with asyncio.timeout(5):
                await self.client.post(worker.url + "/abort_request", json={"rid": rid})

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Cancel background chores (prefill tails, aborts) at shutdown."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


async def _first_failure(p_task: asyncio.Task, d_task: asyncio.Task) -> None:
    """Wait until the decode leg is done; raise as soon as either leg fails."""
    pending = {p_task, d_task}
    while not d_task.done():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if p_task in done and p_task.exception() is not None:
            raise p_task.exception()
    if d_task.exception() is not None:
        if p_task.done() and not p_task.cancelled() and p_task.exception() is not None:
            raise p_task.exception()  # the prefill's error is the cause
        raise d_task.exception()


def _merge_events(splitter: EventSplitter, merger: StreamMerger, chunk: bytes) -> bytes:
    out = []
    for event in splitter.feed(chunk):
        payload = event_data(event)
        if payload is None or payload == b"[DONE]":
            out.append(event + b"\n\n")
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            out.append(event + b"\n\n")
            continue
        out.append(frame(merger.merge(obj)) if isinstance(obj, dict) else event + b"\n\n")
    return b"".join(out)


async def _close_quietly(response: httpx.Response) -> None:
    with contextlib.suppress(Exception):
        await response.aclose()
