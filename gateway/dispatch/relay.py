"""Relaying a decode's stream to the client: whole SSE events, deadlines, a record to resume.

* Bytes pass through as the server sent them (merged only for prompt logprobs), but only up
  to the last complete event: a partial event is held back until its end arrives, so the
  client's stream is well formed whatever happens next (an error event, or a continuation
  spliced in by gateway/dispatch/failover.py).
* One timer per stream (`StreamWatchdog`) keeps two deadlines: the server's silence (learned
  per server by gateway/health/deadlines.py, bounded by --stream-idle-timeout) and the client's
  (--send-timeout: a client that stops reading loses its stream, both legs are aborted).
* For a request that can be resumed (`attempt.resumable`), what the client received is kept
  in `attempt.capture`, and a decode failing mid-stream does not end the stream with an error
  event: once this stream is cleaned up, the same generator goes on with what
  `attempt.on_broken(StreamBroken)` yields (proxy.Resumed: the rest from another pair,
  gateway/dispatch/failover.py). So a resumable stream costs no extra generator layer per chunk.
* At its end a stream tells the request's usage how many chunks it relayed and its last
  events (an OpenAI stream cut before its usage event still counts what it relayed:
  gateway/observability/answer_tokens.py `relayed_tokens`): the capture's chunks, or a
  local count per chunk where there is none.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson

from gateway.cancel import Interrupt
from gateway.dispatch.attempt import Attempt, Timeouts
from gateway.dispatch.prompt_logprobs import StreamMerger
from gateway.dispatch.stream_failure import error_ending, failing_event, marks
from gateway.errors import UpstreamError
from gateway.health.deadlines import LatencyModel
from gateway.health.queue_wait import DecodeQueue
from gateway.sse import (
    DONE,
    EventSplitter,
    data_objects,
    ends_finished,
    event_data,
    frame,
    parsed,
    whole_events,
)
from gateway.timers import Timers
from gateway.upstream.client import UpstreamResponse, leg_error, status_error

CAPTURE_LIMIT = 8 << 20  # bytes of one stream kept for a continuation


class SlowClient(Exception):
    """The client took no chunk for the send timeout (`--send-timeout`)."""


class StreamBroken(Exception):
    """The decode failed mid-stream and the stream may be continued on another pair."""

    def __init__(self, error: UpstreamError, decode) -> None:
        super().__init__(error.detail)
        self.error = error
        self.decode = decode  # the server that failed: the continuation avoids it


class Capture:
    """The events relayed so far, for a continuation (bounded: past the limit, none; only
    how many chunks, for the usage of a stream cut before its usage event)."""

    __slots__ = ("chunks", "size", "usable", "past")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.usable = True
        self.past = 0  # chunks not kept, past the limit

    def add(self, data: bytes) -> None:
        if self.usable:
            self.size += len(data)
            if self.size > CAPTURE_LIMIT:
                self.usable, self.past, self.chunks = False, len(self.chunks) + 1, []
            else:
                self.chunks.append(data)
        else:
            self.past += 1

    def objects(self) -> list[dict]:
        """The JSON objects of the relayed events, in order."""
        return data_objects(b"".join(self.chunks))


class StreamWatchdog:
    """The deadlines of one relayed stream with ONE timer, not one per chunk (a timer per
    chunk was a fifth of the relay's CPU). While the relay waits for the server, the server
    has `idle` seconds per chunk; while the client is being sent a chunk, the client has
    `send` seconds to take it. Each phase only notes when it began; the timer wakes at the
    current phase's deadline or after `period` (half the shorter limit), whichever is first,
    so a phase that began between two checks is caught at most `period` late, and the
    interrupt that stops the waiting fires."""

    __slots__ = ("idle", "send", "period", "loop", "since", "reading", "handle", "upstream",
                 "client", "stalled", "queued")

    def __init__(self, idle, send: float, client: Interrupt | None,
                 stalled: UpstreamError, period: float | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.idle = idle  # seconds, or a callable giving the current limit (learned)
        self.send = send
        limit = idle() if callable(idle) else idle
        self.period = period if period is not None else min(limit, send) / 2
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self.since = self.loop.time()
        self.reading = True
        self.upstream = Interrupt(loop=self.loop)  # the relay's task, stopped when the server goes silent
        self.client = client  # the request's interrupt, fired when the client stops reading
        self.stalled = stalled
        self.queued: DecodeQueue | None = None  # a silence in the decode's queue is no hang
        self.handle = self.loop.call_at(self.since + self.period, self._check)

    # Phases: `since` is when the current one began, `reading` says which it is (the relay
    # waits for the server, True, or a chunk is being sent to the client, False). The
    # relay writes both itself, twice per chunk, rather than calling a method to.

    def _check(self) -> None:
        now = self.loop.time()
        if self.reading:
            limit = self.idle() if callable(self.idle) else self.idle
        else:
            limit = self.send
        due = self.since + limit
        if now < due:
            self.handle = self.loop.call_at(min(due, now + self.period), self._check)
        elif self.reading:
            later = self.queued.look(self.since, now, limit, time.monotonic() - now) \
                if self.queued is not None else None
            if later is None:
                self.upstream.fire(self.stalled)
            else:
                self.handle = self.loop.call_at(later, self._check)
        elif self.client is not None:
            self.client.fire(SlowClient())

    def close(self) -> None:
        self.handle.cancel()


Ended = Callable[[Attempt, UpstreamResponse, asyncio.Task, "bool | None"], None]


class StreamRelay:
    """Relays decode streams under the deadlines of `model` and `timeouts`; `ended` is told
    once a stream ends (ok True, False: the decode failed, None: the client left), and ends
    the decode leg (pd.PDDispatcher._stream_ended)."""

    def __init__(self, model: LatencyModel, timeouts: Timeouts, timers: Timers,
                 ended: Ended) -> None:
        self.model = model
        self.timeouts = timeouts
        self.timers = timers
        self.ended = ended

    async def stream(self, attempt: Attempt, response: UpstreamResponse, first: bytes,
                     merger: StreamMerger | None, p_task: asyncio.Task) -> AsyncIterator[bytes]:
        """The decode's events, then on failure an error event or `attempt.on_broken`'s."""
        ok = broken = failure = None  # ok: bool | None; broken: StreamBroken | None
        splitter, watchdog = (EventSplitter() if merger else None), self._start(attempt)
        model, url, loop = self.model, attempt.decode.url, watchdog.loop
        gaps, queue, relayed = model.gaps_of(url), watchdog.queued, 0  # relayed: see below
        held = last = prior = b""  # last: the last events relayed ([DONE] among them)
        unsuffix, capture, trace = attempt.unsuffix, attempt.capture, attempt.trace
        try:
            (opening, at, to), chunk, now = marks(attempt.view.endpoint), first, loop.time()
            while chunk is not None:
                out = _merge_events(splitter, merger, chunk) if splitter else chunk
                if held:
                    out, held = held + out, b""
                if out[-2:] != b"\n\n" and out:  # hold back a partial event (the common
                    out, held = whole_events(out)  # end checked inline: a slice, no call)
                if out:
                    if unsuffix is not None:  # whole events: a suffix a read cut is whole
                        out = out.replace(unsuffix, b"")
                    if out[at:to] == b"e" and out.startswith(opening):  # see stream_failure
                        out, failure = _failed(out, attempt)
                if out:
                    prior, last, watchdog.since, watchdog.reading = last, out, now, False
                    if capture is not None:  # (its chunks counted there, for usage.py)
                        capture.add(out)
                    else:  # chunks relayed, each of whole events: a cut stream's count
                        relayed += 1
                    if trace is not None:
                        trace.relayed(out)
                    yield out
                    now = loop.time()
                if failure is not None:
                    raise failure
                watchdog.since = started = now  # waiting for the server again
                watchdog.reading = True
                try:  # here, not in a helper coroutine: one coroutine less per chunk
                    chunk = await response.next_chunk()
                except (asyncio.CancelledError, Exception) as exc:
                    raise _failure(exc, watchdog, url)  # noqa: B904 (its own cause)
                now = loop.time()
                if gaps.skip:  # (`LatencyModel.gap` keeps one gap in a few: no call here)
                    gaps.skip -= 1
                elif queue.since != started:  # a wait in the decode's queue is no step
                    model.gap(gaps, now - started)
            if rest := _rest(held, splitter, merger, url, unsuffix):
                yield (last := _noted(rest, capture, trace))
            if not (last.endswith(DONE) or ends_finished(last, prior)):
                raise _unfinished(url)
            ok = True
        except UpstreamError as exc:
            ok, broken, ending = _ended_by(exc, attempt)
            if ending:  # none when the rest comes from another pair
                yield ending
        finally:
            self._end(attempt, response, p_task, ok, watchdog, broken, relayed, last)
        if broken is not None:  # this pair is done with; the rest comes from another
            async with contextlib.aclosing(attempt.on_broken(broken)) as rest_of:
                async for chunk in rest_of:
                    yield chunk

    def _start(self, attempt: Attempt) -> StreamWatchdog:
        """The stream's deadlines: the decode's learned gap (re-read at every check: the
        model learns while we stream) and the client's send timeout. A rescue now stops
        the relay's wait."""
        url, model, hard = attempt.decode.url, self.model, self.timeouts.stream_idle
        send, urgency = self.timeouts.send, attempt.urgency

        def idle() -> float:
            return model.gap_deadline(url, hard, urgency)

        stalled = UpstreamError(f"decode server {url} went silent mid-stream (longer than its "
                                "learned gap deadline)", leg="decode", server_url=url,
                                retryable=True, status=504)
        tracked = attempt.tracked
        watchdog = StreamWatchdog(idle, send, tracked.interrupt if tracked is not None else None,
                                  stalled, period=min(model.floor(urgency), send, hard) / 2,
                                  loop=self.timers.loop())
        decode, gaps = attempt.decode, model.gaps_of(url)  # its streams' chunks: progress
        watchdog.queued = DecodeQueue(decode, lambda: gaps.count + decode.last_success, hard,
                                      model.options.floor)
        attempt.interrupt = watchdog.upstream
        if attempt.trace is not None:
            attempt.trace.relay_started()
        return watchdog

    def _end(self, attempt: Attempt, response: UpstreamResponse, p_task: asyncio.Task,
             ok: bool | None, watchdog: StreamWatchdog, broken: StreamBroken | None,
             relayed: int, last: bytes) -> None:
        watchdog.close()
        watchdog.upstream.close()
        self.ended(attempt, response, p_task, ok)
        usage = attempt.tracked.usage if attempt.tracked is not None else None
        if usage is not None and usage.streams is not None:  # an OpenAI stream's: what it
            capture = attempt.capture  # still counts when cut before its usage event
            if capture is not None:
                relayed = len(capture.chunks) + capture.past
            usage.streams.append((ok, relayed, last, capture))
        if attempt.trace is not None:
            attempt.trace.relay_done(ok, broken is not None)

    def closer(self, attempt: Attempt, response: UpstreamResponse, p_task: asyncio.Task,
               stream: AsyncIterator[bytes]) -> Callable[[], Awaitable[None]]:
        """The answer's close: a stream closed before it started ends here."""
        async def close() -> None:
            await stream.aclose()
            self.ended(attempt, response, p_task, None)

        return close


def _ended_by(exc: UpstreamError, attempt: Attempt
              ) -> tuple[bool | None, StreamBroken | None, bytes]:
    """(the leg's outcome, the break to continue from, the error event to end with) for a
    stream that failed: not retryable is the request's fault, no verdict on the server."""
    if exc.retryable and attempt.on_broken is not None:
        return False, StreamBroken(exc, attempt.decode), b""
    if attempt.tracked is not None:  # the request failed, its error event sent: counted so
        attempt.tracked.failure = exc  # (routes/inference.py), not as its head's 200
    return (False if exc.retryable else None), None, error_ending(exc, attempt.view.endpoint)


def _failed(out: bytes, attempt: Attempt) -> tuple[bytes, UpstreamError | None]:
    """(`out`, None) when no event of it reports a failure (the mark was in the text); else
    the events before the failing one and the decode's failure, as a failed leg's status
    (a 5xx: retryable, so a resumable stream goes on on another pair)."""
    found = failing_event(out, attempt.view.endpoint)
    if found is None:
        return out, None
    before, status, message = found
    return before, status_error("decode", attempt.decode, status,
                                orjson.dumps({"error": {"message": message}}))


def _failure(exc: BaseException, watchdog: StreamWatchdog, url: str) -> BaseException:
    """What to raise for an exception while waiting for the server's next chunk: the reason
    of our own interrupt (the server went silent, or was rescued), the client's error as the
    leg's UpstreamError, or the exception itself."""
    if isinstance(exc, asyncio.CancelledError):
        return watchdog.upstream.reason() or exc
    return leg_error("decode", url, exc)


def _unfinished(url: str) -> UpstreamError:
    return UpstreamError(f"decode server {url} ended the stream without [DONE]",
                         leg="decode", server_url=url, retryable=True)


def _noted(data: bytes, capture: Capture | None, trace) -> bytes:
    """`data`, kept for a continuation and traced as relayed."""
    if capture is not None:
        capture.add(data)
    if trace is not None:
        trace.relayed(data)
    return data


def _rest(held: bytes, splitter: EventSplitter | None, merger: StreamMerger | None,
          url: str, unsuffix: bytes | None) -> bytes:
    """What is left when the server's stream ended: a last event without its blank line
    (completed, when its data is whole, the client rid's suffix cut), or nothing. A data
    line cut short (the server or a proxy closed mid-event) is the decode's failure, never
    relayed: the client's stream stays well formed, and a resumable one goes on elsewhere."""
    if not _whole_data(held + (splitter.rest() if splitter else b""), url):
        return b""
    rest = held + (_merge_events(splitter, merger, b"\n\n") if splitter else b"")
    if unsuffix is not None:
        rest = rest.replace(unsuffix, b"")
    return rest if rest.endswith(b"\n\n") else rest + b"\n\n"


def _whole_data(partial: bytes, url: str) -> bool:
    """Whether the last event of a stream, without its blank line, carries whole data
    (raises when its data was cut off; False when it has none to relay)."""
    if not partial.strip():
        return False
    payload = event_data(partial.strip(b"\r\n"))
    if payload is None:  # no data line (a comment, or a field cut short): nothing to relay
        return False
    if payload != b"[DONE]":
        try:
            orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"decode server {url} ended the stream inside an event (its "
                                "data cut off)", leg="decode", server_url=url,
                                retryable=True) from None
    return True


async def first_event(response: UpstreamResponse, url: str) -> bytes:
    """The stream's bytes up to its first whole event (b"" if it ended with none): a stream
    counts as begun, and can no longer be retried from scratch, only once the client can be
    sent a whole event. A cut in the first event is then a failure before the first chunk."""
    first = await response.next_chunk()
    while first and b"\n\n" not in first and not whole_events(first)[0]:
        more = await response.next_chunk()
        if more is None:
            return first if _whole_data(first, url) else b""
        first += more
    return first or b""


def _merge_events(splitter: EventSplitter, merger: StreamMerger, chunk: bytes) -> bytes:
    """Prompt logprobs merged into each JSON event; other events pass as they are."""
    return b"".join(frame(merger.merge(obj)) if isinstance(obj, dict) else event + b"\n\n"
                    for event, _, obj in parsed(splitter, chunk))
