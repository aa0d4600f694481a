"""Two-leg PD dispatch on one (prefill, decode) pair: one attempt, no retries here.

Both legs are sent at once with the same body (plus bootstrap fields). The first failure of
either leg cancels the other at once (closing its connection, and asking the server to abort
by request id), so a dead prefill never leaves a decode waiting minutes for KV. Non-streaming
answers are read whole; streams are relayed byte for byte, and the attempt only "succeeds"
once the decode produced its first chunk, so a retry can still happen before the client has
seen anything.

The decode leg runs in the caller's task and the prefill leg in a second task whose failure
interrupts the decode (cancel + uncancel, as asyncio.timeout does): two legs, one extra task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import orjson

from gateway.bootstrap import RoomAllocator
from gateway.cancel import Interrupt
from gateway.errors import BadRequest, UpstreamError
from gateway.inflight import Tracked, new_id
from gateway.logprobs import StreamMerger, merge_body, prefill_parts
from gateway.probe import FOLLOW_ROOM
from gateway.request import RequestView
from gateway.sse import DONE, EventSplitter, event_data, frame, leading_failure
from gateway.upstream import Upstream, UpstreamResponse, status_error, translate_errors
from gateway.workers import Worker

LegCallback = Callable[["Attempt", str, "bool | None"], None]


@dataclass(frozen=True)
class Timeouts:
    response: float  # non-streaming answer, or a stream's first chunk
    stream_idle: float  # gap between two streamed chunks
    send: float = 30.0  # how long a client may take to accept one streamed chunk
    tail: float = 30.0  # how long a prefill answer may trail a finished decode
    abort: float = 5.0  # bound of a best-effort /abort_request


@dataclass(eq=False)
class Attempt:
    """One dispatch on a pair, with its rooms and rids; `outcome` records what each leg did.

    `rid_list` holds the rid of every item as the servers know it; `rid` is set only when the
    gateway made them (random, so aborting them by rid can hit nothing else: see
    gateway/inflight.py on SGLang's prefix match)."""

    view: RequestView
    prefill: Worker
    decode: Worker
    rooms: int | list[int]
    rid: str | list[str] | None
    rid_list: tuple[str, ...]
    payload: bytes
    request_id: str
    tracked: Tracked | None = None
    prefill_rank: int | None = None  # the DP rank the prefill leg is steered to
    prefill_payload: bytes = b""  # the prefill leg's body when it differs (routed_dp_rank)
    prefill_target: object = None  # what the policy chose: the prefill Worker or its Rank
    prefill_future: asyncio.Future | None = None  # told (worker, rank) or None when done
    outcome: dict[str, bool | None] = field(default_factory=dict)


@dataclass
class Answer:
    """The decode's answer: a whole body, or a first chunk plus the rest of the stream."""

    status: int
    content_type: bytes
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], Awaitable[None]] | None = None  # always awaited by the responder


class _PrefillWatch:
    """Done-callback of the prefill task: a failure interrupts the decode leg's task."""

    __slots__ = ("interrupt", "armed")

    def __init__(self, interrupt: Interrupt) -> None:
        self.interrupt = interrupt
        self.armed = True

    def __call__(self, prefill: asyncio.Task) -> None:
        error = None if prefill.cancelled() else prefill.exception()  # always retrieved
        if self.armed and error is not None:
            self.armed = False
            self.interrupt.fire(error)


class _StreamWatchdog:
    """The deadlines of one relayed stream with ONE timer, not one per chunk (a timer per
    chunk was a fifth of the relay's CPU). While the relay waits for the server, the server
    has `idle` seconds per chunk; while the client is being sent a chunk, the client has
    `send` seconds to take it. Waiting only moves a deadline; the timer re-arms itself until
    a deadline really passed, then fires the interrupt that stops the waiting."""

    __slots__ = ("idle", "send", "loop", "deadline", "reading", "handle", "upstream", "client")

    def __init__(self, idle: float, send: float, client: Interrupt | None) -> None:
        self.idle = idle
        self.send = send
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + idle
        self.reading = False
        self.upstream = Interrupt()  # the relay's task, stopped when the server goes silent
        self.client = client  # the request's interrupt, fired when the client stops reading
        self.handle = self.loop.call_at(self.deadline, self._check)

    def waiting(self) -> None:
        """The relay waits for the server's next chunk."""
        self.deadline = self.loop.time() + self.idle
        self.reading = True

    def handing_out(self) -> None:
        """The relay gave a chunk to the sender: now the client must take it."""
        self.deadline = self.loop.time() + self.send
        self.reading = False

    def _check(self) -> None:
        now = self.loop.time()
        if now < self.deadline:
            self.handle = self.loop.call_at(self.deadline, self._check)
        elif self.reading:
            self.upstream.fire(StreamStalled())
        elif self.client is not None:
            self.client.fire(SlowClient())

    def close(self) -> None:
        self.handle.cancel()


class StreamStalled(Exception):
    """The server sent nothing for the idle timeout."""


class SlowClient(Exception):
    """The client took no chunk for the send timeout (`--send-timeout`)."""


class PDDispatcher:
    def __init__(self, upstream: Upstream, control: Upstream, rooms: RoomAllocator,
                 timeouts: Timeouts) -> None:
        self.upstream = upstream
        self.control = control  # for best-effort aborts
        self.rooms = rooms
        self.timeouts = timeouts
        self.on_leg_done: LegCallback = lambda attempt, leg, ok: None
        self.on_prefill_body: Callable[[Attempt, bytes], None] = lambda attempt, body: None
        self._background: set[asyncio.Task] = set()

    # -- building the attempt -------------------------------------------------------------

    def prepare(self, view: RequestView, prefill: Worker, decode: Worker,
                tracked: Tracked, rank: int | None = None) -> Attempt:
        """New rooms (never reused, also not on retry) and the body both legs receive.

        `rank`: the prefill's DP rank the request must run on. A prefill that follows
        bootstrap rooms (SGLang's default on a PD prefill) is steered by the room itself:
        `room % ranks == rank` (`follow_bootstrap_room_scheduler`), which its decode also
        computes (`_resolve_prefill_dp_rank`), so no extra field is needed on any SGLang
        version. A prefill balancing otherwise gets `routed_dp_rank` (its prefill leg only:
        on the decode leg it would pin the decode's own rank); it registers the rank with its
        bootstrap server, where the decode looks it up."""
        if prefill.bootstrap_port is None:
            raise UpstreamError(f"prefill server {prefill.url} has no known bootstrap port",
                                leg="prefill", worker_url=prefill.url, retryable=True)
        count = view.room_count
        routed = rank is not None and prefill.load_balance_method != FOLLOW_ROOM
        if rank is None or routed:
            rooms = self.rooms.take(count)
        else:
            rooms = self.rooms.take(count, prefill.dp_size, rank)
        body = dict(view.body)
        if count is None:
            body["bootstrap_host"] = prefill.bootstrap_host
            body["bootstrap_port"] = prefill.bootstrap_port
        else:
            body["bootstrap_host"] = [prefill.bootstrap_host] * count
            body["bootstrap_port"] = [prefill.bootstrap_port] * count
        body["bootstrap_room"] = rooms
        own_rid, rid_list = _rids(body.get("rid"), count)
        if own_rid is not None:
            body["rid"] = own_rid
        try:
            payload = orjson.dumps(body)
            prefill_payload = payload
            if routed:
                body["routed_dp_rank"] = rank
                prefill_payload = orjson.dumps(body)
        except orjson.JSONEncodeError as exc:  # e.g. nesting deeper than orjson writes
            raise BadRequest(f"request body cannot be forwarded: {exc}") from None
        attempt = Attempt(view, prefill, decode, rooms, own_rid, rid_list, payload,
                          tracked.request_id, tracked, prefill_rank=rank)
        attempt.prefill_payload = prefill_payload
        attempt.prefill_target = prefill if rank is None else prefill.ranks[rank]
        return attempt

    # -- one attempt -----------------------------------------------------------------------

    async def run(self, attempt: Attempt) -> Answer:
        """Send both legs; return the decode answer or raise the first leg failure."""
        interrupt = Interrupt()
        p_task = asyncio.get_running_loop().create_task(self._prefill_leg(attempt))
        watch = _PrefillWatch(interrupt)
        p_task.add_done_callback(watch)
        response: UpstreamResponse | None = None
        handed_over = False
        try:
            async with asyncio.timeout(self.timeouts.response):
                response, answer = await self._decode_leg(attempt)
                watch.armed = False
                merger = None
                if attempt.view.logprob_merge:
                    parts = prefill_parts(attempt.view.endpoint, await p_task)
                    if response is None:
                        answer.body = merge_body(attempt.view.endpoint, answer.body, parts)
                    else:
                        merger = StreamMerger(attempt.view.endpoint, parts)
            if response is not None:
                answer.stream = self._relay(attempt, response, answer.body, merger, p_task)
                answer.body, handed_over = b"", True
                answer.close = self._closer(attempt, response, p_task, answer.stream)
            return answer
        except asyncio.CancelledError:
            if (reason := interrupt.reason()) is not None:
                raise reason from None
            raise
        except TimeoutError:
            raise self._timed_out(attempt, p_task) from None
        finally:
            watch.armed = False
            if not handed_over:
                self._settle(attempt, p_task, response)

    def _timed_out(self, attempt: Attempt, p_task: asyncio.Task) -> UpstreamError:
        """No answer in time. Each leg still waiting is a suspect (a hung decode keeps its
        prefill waiting too, and the reverse): both feed their breakers and both are avoided
        by the retry."""
        late = [leg for leg in ("prefill", "decode") if leg not in attempt.outcome]
        if "decode" in late and p_task.done():
            late = ["decode"]
        for leg in late:
            self._leg_done(attempt, leg, False)
        workers = " and ".join(
            f"{leg} server {(attempt.prefill if leg == 'prefill' else attempt.decode).url}"
            for leg in late) or "the pair"
        leg = late[0] if len(late) == 1 else "both"
        url = attempt.decode.url if leg == "decode" else attempt.prefill.url
        return UpstreamError(f"{workers} gave no answer within {self.timeouts.response:g}s",
                             leg=leg, worker_url=url, retryable=True, status=504)

    def _settle(self, attempt: Attempt, p_task: asyncio.Task,
                response: UpstreamResponse | None) -> None:
        """After a failure or a whole answer: stop what still runs, account every leg."""
        decode_ok = "decode" in attempt.outcome and attempt.outcome["decode"] is True
        if response is not None:  # a stream opened but never handed to a relay
            response.abort()
        if "decode" not in attempt.outcome:
            self._leg_done(attempt, "decode", None)
            self._abort(attempt.decode, attempt.rid)
        if not p_task.done():
            if decode_ok and response is None:
                self._finish_tail(attempt, p_task)
            else:
                p_task.cancel()
                self._abort(attempt.prefill, attempt.rid)

    def _finish_tail(self, attempt: Attempt, p_task: asyncio.Task) -> None:
        """The decode is done; give the prefill's own answer a bounded time to arrive.

        A timer and a done-callback, not a task: this happens on most successful requests."""
        handle = asyncio.get_running_loop().call_later(
            self.timeouts.tail, self._tail_expired, attempt, p_task)
        self._background.add(p_task)
        p_task.add_done_callback(lambda task: (handle.cancel(), self._background.discard(task)))

    def _tail_expired(self, attempt: Attempt, p_task: asyncio.Task) -> None:
        if not p_task.done():
            p_task.cancel()
            self._abort(attempt.prefill, attempt.rid)

    # -- the legs ----------------------------------------------------------------------------

    async def _open(self, attempt: Attempt, leg: str, worker: Worker) -> UpstreamResponse:
        with translate_errors(leg, worker):
            payload = attempt.prefill_payload if leg == "prefill" else attempt.payload
            response = await self.upstream.post(worker.url, attempt.view.path, payload,
                                                attempt.request_id)
            if response.status >= 400:
                try:
                    body = await response.read()
                finally:
                    response.abort()
                raise status_error(leg, worker, response.status, body)
        return response

    async def _prefill_leg(self, attempt: Attempt) -> bytes:
        ok: bool | None = None
        response = None
        try:
            response = await self._open(attempt, "prefill", attempt.prefill)
            with translate_errors("prefill", attempt.prefill):
                body = await response.read()
            response = None
            ok = True
            self.on_prefill_body(attempt, body)
            return body
        except UpstreamError as exc:
            ok = False if exc.retryable else None
            raise
        finally:
            if response is not None:
                response.abort()
            self._leg_done(attempt, "prefill", ok)
            future = attempt.prefill_future
            if future is not None and not future.done():
                future.set_result((attempt.prefill, attempt.prefill_rank) if ok else None)

    async def _decode_leg(self, attempt: Attempt) -> tuple[UpstreamResponse | None, Answer]:
        """Non-streaming: the whole body (response None). Streaming: the open response and
        its first chunk in `answer.body`; the relay accounts the leg when the stream ends."""
        response = None
        try:
            response = await self._open(attempt, "decode", attempt.decode)
            content_type = response.header(b"content-type") or b"application/json"
            with translate_errors("decode", attempt.decode):
                if not attempt.view.stream:
                    body = await response.read()
                    response = None
                    self._leg_done(attempt, "decode", True)
                    return None, Answer(200, content_type, body)
                first = await response.next_chunk()
            failure = leading_failure(first) if first else None
            if failure is not None:
                status, message = failure
                raise status_error("decode", attempt.decode, status,
                                   orjson.dumps({"error": {"message": message}}))
            if not first:
                raise UpstreamError(f"decode server {attempt.decode.url} closed the stream "
                                    "before sending anything", leg="decode",
                                    worker_url=attempt.decode.url, retryable=True)
            opened, response = response, None
            return opened, Answer(200, content_type, first)
        except UpstreamError as exc:
            self._leg_done(attempt, "decode", False if exc.retryable else None)
            raise
        finally:
            if response is not None:
                response.abort()

    def _leg_done(self, attempt: Attempt, leg: str, ok: bool | None) -> None:
        if leg in attempt.outcome:
            return
        attempt.outcome[leg] = ok
        self.on_leg_done(attempt, leg, ok)

    # -- streaming relay -----------------------------------------------------------------------

    async def _relay(self, attempt: Attempt, response: UpstreamResponse, first: bytes,
                     merger: StreamMerger | None, p_task: asyncio.Task) -> AsyncIterator[bytes]:
        """Yield the decode's SSE bytes; a mid-stream failure ends with an error event."""
        ok: bool | None = None
        splitter = EventSplitter() if merger else None
        tail = b""
        tracked = attempt.tracked
        watchdog = _StreamWatchdog(self.timeouts.stream_idle, self.timeouts.send,
                                   tracked.interrupt if tracked is not None else None)
        try:
            chunk: bytes | None = first
            while chunk is not None:
                out = _merge_events(splitter, merger, chunk) if splitter else chunk
                if out:
                    tail = (tail + out)[-16:]
                    watchdog.handing_out()
                    yield out
                chunk = await self._next_chunk(attempt, response, watchdog)
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
            watchdog.close()
            self._end_stream(attempt, response, p_task, ok)

    async def _next_chunk(self, attempt: Attempt, response: UpstreamResponse,
                          watchdog: _StreamWatchdog) -> bytes | None:
        """The next raw chunk within the idle timeout; None at the end of the stream."""
        watchdog.waiting()
        try:
            with translate_errors("decode", attempt.decode):
                return await response.next_chunk()
        except asyncio.CancelledError:
            if watchdog.upstream.reason() is not None:
                raise UpstreamError(
                    f"decode server {attempt.decode.url} sent nothing for "
                    f"{self.timeouts.stream_idle:g}s", leg="decode",
                    worker_url=attempt.decode.url, retryable=True, status=504) from None
            raise

    def _end_stream(self, attempt: Attempt, response: UpstreamResponse, p_task: asyncio.Task,
                    ok: bool | None) -> None:
        """Idempotent cleanup of a stream, whether it ran to the end or never started."""
        if "decode" in attempt.outcome:
            return
        if ok is not True:
            response.abort()
        self._leg_done(attempt, "decode", ok)
        if not p_task.done():
            self._finish_tail(attempt, p_task)
        if ok is None:  # the client went away mid-stream
            self._abort(attempt.decode, attempt.rid)

    def _closer(self, attempt: Attempt, response: UpstreamResponse, p_task: asyncio.Task,
                stream: AsyncIterator[bytes]) -> Callable[[], Awaitable[None]]:
        async def close() -> None:
            await stream.aclose()
            self._end_stream(attempt, response, p_task, None)

        return close

    # -- background chores ----------------------------------------------------------------------

    def _abort(self, worker: Worker, rid: str | list[str] | None) -> None:
        """Ask `worker` to stop the attempt's items, only by rids the gateway made (a client's
        rid may prefix-match other requests in SGLang's scheduler)."""
        if rid is None:
            return
        for one in (rid,) if isinstance(rid, str) else rid:
            self._spawn(self._post_abort(worker, one))

    async def _post_abort(self, worker: Worker, rid: str) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeouts.abort):
                response = await self.control.post(
                    worker.url, "/abort_request", orjson.dumps({"rid": rid}), "abort")
                await response.read()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Cancel background chores (prefill tails, aborts) at shutdown."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def _rids(client_rid: object, count: int | None) -> tuple[str | list[str] | None,
                                                  tuple[str, ...]]:
    """(rid field to send when the gateway makes it, every item's rid on the servers).

    A client's rid is sent as it came; SGLang turns a string rid of a batch into
    f"{rid}_{i}" (`GenerateReqInput._normalize_rid`). Otherwise every item gets a new random
    rid, per attempt, so a retry never meets its predecessor on a server."""
    if client_rid is None:
        if count is None:
            rid = new_id()
            return rid, (rid,)
        rids = [new_id() for _ in range(count)]
        return rids, tuple(rids)
    if isinstance(client_rid, str):
        return None, ((client_rid,) if count is None
                      else tuple(f"{client_rid}_{i}" for i in range(count)))
    return None, tuple(client_rid)


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
