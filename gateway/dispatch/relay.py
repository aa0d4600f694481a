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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson

from gateway.cancel import Interrupt
from gateway.dispatch.attempt import Attempt
from gateway.dispatch.prompt_logprobs import StreamMerger
from gateway.errors import UpstreamError
from gateway.sse import DONE, EventSplitter, event_data, frame
from gateway.upstream.client import UpstreamResponse, translated

CAPTURE_LIMIT = 8 << 20  # bytes of one stream kept for a continuation


class SlowClient(Exception):
    """The client took no chunk for the send timeout (`--send-timeout`)."""


class StreamBroken(Exception):
    """The decode failed mid-stream and the stream may be continued on another pair."""

    def __init__(self, error: UpstreamError, decode) -> None:
        super().__init__(error.message)
        self.error = error
        self.decode = decode  # the server that failed: the continuation avoids it


class Capture:
    """The events relayed so far, for a continuation (bounded: past the limit, none)."""

    __slots__ = ("chunks", "size", "usable")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.usable = True

    def add(self, data: bytes) -> None:
        if self.usable:
            self.size += len(data)
            if self.size > CAPTURE_LIMIT:
                self.usable, self.chunks = False, []
            else:
                self.chunks.append(data)

    def objects(self) -> list[dict]:
        """The JSON objects of the relayed events, in order."""
        out = []
        for event in EventSplitter().feed(b"".join(self.chunks)):
            payload = event_data(event)
            if payload is None or payload == b"[DONE]":
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out


class StreamWatchdog:
    """The deadlines of one relayed stream with ONE timer, not one per chunk (a timer per
    chunk was a fifth of the relay's CPU). While the relay waits for the server, the server
    has `idle` seconds per chunk; while the client is being sent a chunk, the client has
    `send` seconds to take it. Each phase only notes when it began; the timer wakes at the
    current phase's deadline or after `period` (half the shorter limit), whichever is first,
    so a phase that began between two checks is caught at most `period` late, and the
    interrupt that stops the waiting fires."""

    __slots__ = ("idle", "send", "period", "loop", "since", "reading", "handle", "upstream",
                 "client", "stalled")

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
            self.upstream.fire(self.stalled)
        elif self.client is not None:
            self.client.fire(SlowClient())

    def close(self) -> None:
        self.handle.cancel()


class StreamRelay:
    """The relay of one dispatcher (it accounts the decode leg when the stream ends)."""

    def __init__(self, dispatcher) -> None:
        self.dispatcher = dispatcher

    async def stream(self, attempt: Attempt, response: UpstreamResponse, first: bytes,
                     merger: StreamMerger | None, p_task: asyncio.Task) -> AsyncIterator[bytes]:
        """Yield the decode's SSE events; a mid-stream failure ends with an error event, or
        (resumable) goes on with `attempt.on_broken`'s continuation."""
        d = self.dispatcher
        ok: bool | None = None
        splitter = EventSplitter() if merger else None
        url = attempt.decode.url
        model, hard = d.model, d.timeouts.stream_idle

        def idle() -> float:  # re-read at every check: the model learns while we stream
            return model.gap_deadline(url, hard)

        stalled = UpstreamError(f"decode server {url} went silent mid-stream (longer than its "
                                "learned gap deadline)", leg="decode", server_url=url,
                                retryable=True, status=504)
        tracked = attempt.tracked
        watchdog = StreamWatchdog(idle, d.timeouts.send,
                                  tracked.interrupt if tracked is not None else None, stalled,
                                  period=min(model.options.floor, d.timeouts.send, hard) / 2,
                                  loop=d.timers.loop())
        attempt.interrupt = watchdog.upstream  # a rescue now stops the relay's wait
        loop = watchdog.loop
        gaps = model.gaps_of(url)
        held = b""
        last = b""  # the last events relayed (whole events: [DONE] is in them, or missing)
        unsuffix = attempt.unsuffix
        capture = attempt.capture
        broken: StreamBroken | None = None
        trace = attempt.trace  # tracing.AttemptTrace, or None (tracing off)
        if trace is not None:
            trace.relay_started()
        try:
            chunk: bytes | None = first
            now = loop.time()
            while chunk is not None:
                out = _merge_events(splitter, merger, chunk) if splitter else chunk
                if unsuffix is not None:
                    out = out.replace(unsuffix, b"")
                if held:
                    out, held = held + out, b""
                if out and not out.endswith(b"\n\n"):  # hold back a partial event
                    cut = out.rfind(b"\n\n") + 2
                    out, held = (out[:cut], out[cut:]) if cut > 1 else (b"", out)
                if out:
                    last = out
                    watchdog.since, watchdog.reading = now, False  # handing out
                    if capture is not None:
                        capture.add(out)
                    if trace is not None:
                        trace.relayed(out)
                    yield out
                    now = loop.time()
                watchdog.since = started = now  # waiting for the server again
                watchdog.reading = True
                try:  # here, not in a helper coroutine: one coroutine less per chunk
                    chunk = await response.next_chunk()
                except asyncio.CancelledError:
                    if (reason := watchdog.upstream.reason()) is not None:
                        raise reason from None  # the server went silent, or was rescued
                    raise
                except Exception as exc:  # the client's errors, as the leg's UpstreamError
                    error = translated("decode", url, exc)
                    if error is None:
                        raise
                    raise error from exc
                now = loop.time()
                if gaps.skip:  # (`LatencyModel.gap` keeps one gap in a few: no call here)
                    gaps.skip -= 1
                else:
                    model.gap(gaps, now - started)
            rest = held + (_merge_events(splitter, merger, b"\n\n") if splitter
                           and splitter.rest().strip() else b"")
            if rest.strip():
                rest = last = rest if rest.endswith(b"\n\n") else rest + b"\n\n"
                if capture is not None:
                    capture.add(rest)
                if trace is not None:
                    trace.relayed(rest)
                yield rest
            if not last.endswith(DONE):
                raise UpstreamError(f"decode server {url} ended the stream without [DONE]",
                                    leg="decode", server_url=url, retryable=True)
            ok = True
        except UpstreamError as exc:
            ok = False
            if exc.retryable and attempt.on_broken is not None:
                broken = StreamBroken(exc, attempt.decode)
            else:
                yield frame(exc.body()) + DONE
        finally:
            watchdog.close()
            watchdog.upstream.close()
            self.end(attempt, response, p_task, ok)
            if trace is not None:
                trace.relay_done(ok, broken is not None)
        if broken is not None:  # this pair is done with; the rest comes from another
            rest_of = attempt.on_broken(broken)
            try:
                async for chunk in rest_of:
                    yield chunk
            finally:
                await rest_of.aclose()

    def end(self, attempt: Attempt, response: UpstreamResponse, p_task: asyncio.Task,
            ok: bool | None) -> None:
        """Idempotent cleanup of a stream, whether it ran to the end or never started."""
        if "decode" in attempt.outcome:
            return
        d = self.dispatcher
        if ok is not True:
            response.abort()
        attempt.decode.attempts.discard(attempt)
        d.leg_done(attempt, "decode", ok)
        if not p_task.done():
            d.finish_tail(attempt, p_task)
        if ok is None:  # the client went away mid-stream
            d.abort(attempt.decode, attempt.rid_list)

    def closer(self, attempt: Attempt, response: UpstreamResponse, p_task: asyncio.Task,
               stream: AsyncIterator[bytes]) -> Callable[[], Awaitable[None]]:
        async def close() -> None:
            await stream.aclose()
            self.end(attempt, response, p_task, None)

        return close


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
