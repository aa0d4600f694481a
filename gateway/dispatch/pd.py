"""Two-leg PD dispatch on one (prefill, decode) pair: one attempt, no retries here.

Both legs are sent at once with the same body (plus bootstrap fields). The first failure of
either leg stops the other at once (closing its connection, and asking the server to abort
by request id), so a dead prefill never leaves a decode waiting minutes for KV. Non-streaming
answers are read whole; streams are relayed (gateway/dispatch/relay.py), and the attempt only
"succeeds" once the decode produced its first chunk, so a retry can still happen before the
client has seen anything.

Deadlines: until its first progress (the prefill's answer or the decode's first byte) an
attempt has the deadline learned for its prefill server and prompt size (gateway/health/deadlines.py),
so a hung pair is suspected in seconds; after it, the hard --response-timeout. Every attempt
waiting on a server is registered on it: when the server is marked down or its breaker opens,
`rescue` stops those attempts at once so they are retried elsewhere (when the role has
another usable server; else they keep waiting under these deadlines).

The decode leg runs in the caller's task and the prefill leg in a second task whose failure
interrupts the decode (`Interrupt`, gateway/cancel.py): two legs, one extra task.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import orjson

from gateway.cancel import Deadline, Expired, Interrupt
from gateway.dispatch import rescue
from gateway.dispatch.attempt import Answer, Attempt, Timeouts
from gateway.dispatch.bootstrap_rooms import RoomAllocator
from gateway.dispatch.inflight import Tracked
from gateway.dispatch.leg_bodies import leg_bodies
from gateway.dispatch.prefill_tails import PrefillTails
from gateway.dispatch.prompt_logprobs import StreamMerger, merge_body, prefill_parts
from gateway.dispatch.relay import StreamRelay
from gateway.errors import UpstreamError
from gateway.health.deadlines import LatencyModel
from gateway.request import RequestView
from gateway.servers.pool import Server
from gateway.servers.probe import FOLLOW_ROOM
from gateway.sse import leading_failure
from gateway.timers import Timers
from gateway.upstream.client import Upstream, UpstreamResponse, status_error, translate_errors

__all__ = ["Answer", "Attempt", "PDDispatcher", "Timeouts"]

LegCallback = Callable[[Attempt, str, "bool | None"], None]


class _PrefillWatch:
    """Done-callback of the prefill task: a failure interrupts the decode leg's task; a
    success is the attempt's first progress (the KV is on its way)."""

    __slots__ = ("interrupt", "armed", "dispatcher", "attempt")

    def __init__(self, interrupt: Interrupt, dispatcher: PDDispatcher, attempt: Attempt) -> None:
        self.interrupt = interrupt
        self.armed = True
        self.dispatcher = dispatcher
        self.attempt = attempt

    def __call__(self, prefill: asyncio.Task) -> None:
        error = None if prefill.cancelled() else prefill.exception()  # always retrieved
        self.attempt.prefill.attempts.discard(self.attempt)
        self.dispatcher.tails.ended(prefill)
        if error is None and not prefill.cancelled():
            self.dispatcher.progress(self.attempt, by_prefill=True)
        elif self.armed and error is not None:
            self.armed = False
            self.interrupt.fire(error)


REQUEST_TIMEOUT = "request_timeout"  # UpstreamError.reason: the request's deadline passed


class PDDispatcher:
    def __init__(self, upstream: Upstream, control: Upstream, rooms: RoomAllocator,
                 timeouts: Timeouts, model: LatencyModel | None = None,
                 timers: Timers | None = None) -> None:
        self.upstream = upstream
        self.timers = timers or Timers()
        self.control = control  # for best-effort aborts
        self.rooms = rooms
        self.timeouts = timeouts
        self.model = model or LatencyModel()
        self.relay = StreamRelay(self)
        self.suspect_seconds = 10.0  # how long a suspected hang keeps new requests away
        self.on_leg_done: LegCallback = lambda attempt, leg, ok: None
        self.on_prefill_body: Callable[[Attempt, bytes], None] = lambda attempt, body: None
        self._background: set[asyncio.Task] = set()
        self.tails = PrefillTails(self.timers, timeouts.tail, self._tail_expired)
        self.forward_priority = "off"  # --forward-priority: auto, on, off
        # the servers of a role (runtime: pool.role): a rescue stops attempts only if a
        # retry can go elsewhere (rescue.rescue); None: it always stops them
        self.peers: Callable[[str], list[Server]] | None = None

    # -- building the attempt -------------------------------------------------------------

    def prepare(self, view: RequestView, prefill: Server, decode: Server,
                tracked: Tracked, rank: int | None = None) -> Attempt:
        """New rooms (never reused, also not on retry) and the body both legs receive.

        `rank`: the prefill's DP rank the request must run on. Both legs name it in
        `disagg_prefill_dp_rank`: the decode then fetches the KV from that rank
        (`_resolve_prefill_dp_rank`), and the prefill skips the room/rank check of
        `CommonKVSender.__init__`, which in 0.5.23 compares against `attn_dp_rank` (0 on every
        plain-DP replica) and so fails every room off rank 0 (seen on the CPU rig; older
        servers ignore the unknown field). A prefill that follows bootstrap rooms (SGLang's
        default on a PD prefill) is steered by the room itself: `room % ranks == rank`
        (`follow_bootstrap_room_scheduler`). A prefill balancing otherwise also gets
        `routed_dp_rank` on its leg only (on the decode leg it would pin the decode's own
        rank, and a one-rank decode refuses it)."""
        if prefill.bootstrap_port is None:
            raise UpstreamError(f"prefill server {prefill.url} has no known bootstrap port",
                                leg="prefill", server_url=prefill.url, retryable=True)
        count = view.room_count
        routed = rank is not None and prefill.load_balance_method != FOLLOW_ROOM
        if rank is None or routed:
            rooms = self.rooms.take(count)
        else:
            rooms = self.rooms.take(count, prefill.dp_size, rank)
        legs = leg_bodies(view, prefill, decode, rooms, rank, routed, self.forward_priority)
        attempt = Attempt(view, prefill, decode, rooms, legs.rid, legs.rids, legs.payload,
                          tracked.request_id, tracked, prefill_rank=rank,
                          unsuffix=legs.unsuffix)
        attempt.prefill_payload = legs.prefill_payload
        attempt.prefill_target = prefill if rank is None else prefill.ranks[rank]
        return attempt

    # -- one attempt -----------------------------------------------------------------------

    async def run(self, attempt: Attempt) -> Answer:
        """Send both legs; return the decode answer or raise the first leg failure."""
        loop = self.timers.loop()  # (cached: asyncio.get_running_loop() is a system call)
        interrupt = attempt.interrupt = Interrupt(loop=loop)
        attempt.started_at = loop.time()
        attempt.prefill.attempts.add(attempt)
        attempt.decode.attempts.add(attempt)
        first = self.model.first_progress_deadline(
            attempt.prefill.url, attempt.view.prompt_tokens, self.timeouts.response)
        p_task = loop.create_task(self._prefill_leg(attempt))
        watch = _PrefillWatch(interrupt, self, attempt)
        p_task.add_done_callback(watch)
        response: UpstreamResponse | None = None
        handed_over = False
        deadline = attempt.deadline = Deadline(
            self.timers, interrupt, min(attempt.started_at + first, attempt.not_after))
        try:
            if attempt.progressed:  # the prefill answered before we got here
                limit = attempt.started_at + self.timeouts.response
                if attempt.view.stream:
                    limit = min(limit, loop.time() + self.model.gap_deadline(
                        attempt.decode.url, self.timeouts.response))
                deadline.move(min(limit, attempt.not_after))
            response, answer = await self._decode_leg(attempt)
            self.progress(attempt)
            attempt.decode.last_success = time.monotonic()  # alive: it is answering
            watch.armed = False
            merger = None
            if attempt.view.logprob_merge:
                parts = prefill_parts(attempt.view.endpoint, await p_task)
                if response is None:
                    answer.body = merge_body(attempt.view.endpoint, answer.body, parts)
                else:
                    merger = StreamMerger(attempt.view.endpoint, parts)
            deadline.cancel()
            attempt.deadline = None
            if response is not None:
                answer.stream = self.relay.stream(attempt, response, answer.body, merger, p_task)
                answer.body, handed_over = b"", True
                answer.close = self.relay.closer(attempt, response, p_task, answer.stream)
                attempt.prefill.attempts.discard(attempt)  # it now waits on the decode only
            return answer
        except asyncio.CancelledError:
            if (reason := interrupt.reason()) is not None:
                if isinstance(reason, Expired):
                    raise self._expired(attempt, p_task, first, loop.time()) from None
                if isinstance(reason, UpstreamError):
                    rescue.suspect_if_hung(attempt, loop.time(), first, self.suspect_seconds)
                raise reason from None
            raise
        except UpstreamError:
            rescue.suspect_if_hung(attempt, loop.time(), first, self.suspect_seconds)
            raise
        finally:
            watch.armed = False
            deadline.cancel()
            attempt.deadline = None
            interrupt.close()
            if not handed_over:
                attempt.decode.attempts.discard(attempt)
                attempt.prefill.attempts.discard(attempt)
                self._settle(attempt, p_task, response)

    def progress(self, attempt: Attempt, by_prefill: bool = False) -> None:
        """The pair works (prefill answered, or the decode's first byte): learn how long it
        took. From now on a non-streaming answer has the hard response timeout (its decode
        shows nothing until it is done); a stream whose prefill answered must see its first
        chunk within the decode's learned gap deadline (the KV is there: a silent decode now
        is a hung one)."""
        if attempt.progressed:
            return
        attempt.progressed = True
        # the prefill has computed (it answered, or the decode has its KV), though its HTTP
        # answer may come after the decode's (seen on the CPU rig): its snapshot forgets the
        # request now (a conversation's next turn sent meanwhile found the prefill "busy"),
        # and the other samples of an n > 1 request may follow it now (they waited for that
        # answer and ran one after the other)
        if "prefill" not in attempt.outcome:  # else settled as the leg ended (proxy.leg_done)
            attempt.settle_prefill(trail=True)
        future = attempt.prefill_future
        if future is not None and not future.done():
            future.set_result((attempt.prefill, attempt.prefill_rank))
        now = self.timers.loop().time()
        self.model.first_progress(attempt.prefill.url, attempt.view.prompt_tokens,
                                  now - attempt.started_at)
        if attempt.deadline is not None:
            limit = attempt.started_at + self.timeouts.response
            if by_prefill and attempt.view.stream:
                limit = min(limit, now + self.model.gap_deadline(attempt.decode.url,
                                                                 self.timeouts.response))
            attempt.deadline.move(min(limit, attempt.not_after))

    def rescue(self, server: Server, why: str) -> int:
        """Stop the attempts on `server` (down, breaker open) if a retry can go elsewhere."""
        return rescue.rescue(server, f"{server.role} server {server.url} {why}",
                             None if self.peers is None else self.peers(server.role))

    def _expired(self, attempt: Attempt, p_task: asyncio.Task, first: float,
                 now: float) -> UpstreamError:
        """No answer in time. Each leg still waiting is a suspect (a hung decode keeps its
        prefill waiting too, and the reverse): both feed their breakers and both are avoided
        by the retry. The request's own deadline passing is no server's fault."""
        if now >= attempt.not_after - self.timers.resolution:
            for leg in ("prefill", "decode"):
                self.leg_done(attempt, leg, None)
            return UpstreamError("the request's deadline passed", leg="both",
                                 server_url=attempt.prefill.url, retryable=False, status=504,
                                 reason=REQUEST_TIMEOUT)
        if not attempt.progressed:  # a suspected hang: its cohort on the pair too
            rescue.pair_cohort(attempt)
            rescue.suspect_if_hung(attempt, now, first, self.suspect_seconds)
        elif attempt.view.stream and "prefill" in attempt.outcome:
            rescue.decode_hung(attempt, self.suspect_seconds,  # KV there, decode silent
                               None if self.peers is None else self.peers("decode"))
        late = [leg for leg in ("prefill", "decode") if leg not in attempt.outcome]
        if "decode" in late and p_task.done():
            late = ["decode"]
        for leg in late:
            self.leg_done(attempt, leg, False)
        servers = " and ".join(
            f"{leg} server {(attempt.prefill if leg == 'prefill' else attempt.decode).url}"
            for leg in late) or "the pair"
        leg = late[0] if len(late) == 1 else "both"
        url = attempt.decode.url if leg == "decode" else attempt.prefill.url
        limit = (f"{self.timeouts.response:g}s" if attempt.progressed
                 else f"{first:.3g}s (the deadline learned for this server and prompt size)")
        return UpstreamError(f"{servers} gave no answer within {limit}",
                             leg=leg, server_url=url, retryable=True, status=504)

    def _settle(self, attempt: Attempt, p_task: asyncio.Task,
                response: UpstreamResponse | None) -> None:
        """After a failure or a whole answer: stop what still runs, account every leg."""
        decode_ok = "decode" in attempt.outcome and attempt.outcome["decode"] is True
        if response is not None:  # a stream opened but never handed to a relay
            response.abort()
        if "decode" not in attempt.outcome:
            self.leg_done(attempt, "decode", None)
            self.abort(attempt.decode, attempt.rid_list)
        if not p_task.done():
            if decode_ok and response is None:
                self.finish_tail(attempt, p_task)
            else:
                p_task.cancel()
                self.abort(attempt.prefill, attempt.rid_list)

    def finish_tail(self, attempt: Attempt, p_task: asyncio.Task) -> None:
        """The decode is done; give the prefill's own answer a bounded time to arrive."""
        self.tails.add(attempt, p_task)

    def _tail_expired(self, attempt: Attempt, p_task: asyncio.Task) -> None:
        if not p_task.done():
            p_task.cancel()
            self.abort(attempt.prefill, attempt.rid_list)

    # -- the legs ----------------------------------------------------------------------------

    async def _open(self, attempt: Attempt, leg: str, server: Server) -> UpstreamResponse:
        """The leg's response, its head read; an error status raised. The caller wraps it
        and the body's reading in one `translate_errors`."""
        trace = attempt.trace  # tracing.AttemptTrace, or None (tracing off)
        payload = attempt.prefill_payload if leg == "prefill" else attempt.payload
        response = await self.upstream.post(
            server.url, attempt.view.path, payload, attempt.request_id,
            trace.leg_started(leg, server) if trace is not None else ())
        if trace is not None:
            trace.answered(leg, response.status)
        if response.status >= 400:
            try:
                body = await response.read()
            finally:
                response.abort()
            raise status_error(leg, server, response.status, body)
        return response

    async def _prefill_leg(self, attempt: Attempt) -> bytes:
        ok: bool | None = None
        response = None
        try:
            with translate_errors("prefill", attempt.prefill):
                response = await self._open(attempt, "prefill", attempt.prefill)
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
            self.leg_done(attempt, "prefill", ok)
            future = attempt.prefill_future
            if future is not None and not future.done():
                future.set_result((attempt.prefill, attempt.prefill_rank) if ok else None)

    async def _decode_leg(self, attempt: Attempt) -> tuple[UpstreamResponse | None, Answer]:
        """Non-streaming: the whole body (response None). Streaming: the open response and
        its first chunk in `answer.body`; the relay accounts the leg when the stream ends."""
        response = None
        try:
            with translate_errors("decode", attempt.decode):
                response = await self._open(attempt, "decode", attempt.decode)
                content_type = response.header(b"content-type") or b"application/json"
                if not attempt.view.stream:
                    body = await response.read()
                    if attempt.unsuffix is not None:
                        body = body.replace(attempt.unsuffix, b"")
                    response = None
                    self.leg_done(attempt, "decode", True)
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
                                    server_url=attempt.decode.url, retryable=True)
            opened, response = response, None
            return opened, Answer(200, content_type, first)
        except UpstreamError as exc:
            self.leg_done(attempt, "decode", False if exc.retryable else None)
            raise
        finally:
            if response is not None:
                response.abort()

    def leg_done(self, attempt: Attempt, leg: str, ok: bool | None) -> None:
        if leg in attempt.outcome:
            return
        attempt.outcome[leg] = ok
        if attempt.trace is not None:
            attempt.trace.leg_done(leg, ok)
        self.on_leg_done(attempt, leg, ok)

    # -- background chores ----------------------------------------------------------------------

    def abort(self, server: Server, rids: tuple[str, ...]) -> None:
        """Ask `server` to stop the attempt's items by their upstream rids (unique: random,
        or a client's rid with a random suffix, so SGLang's prefix match hits nothing else)."""
        for one in rids:
            self._spawn(self._post_abort(server, one))

    async def _post_abort(self, server: Server, rid: str) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeouts.abort):
                response = await self.control.post(
                    server.url, "/abort_request", orjson.dumps({"rid": rid}), "abort")
                await response.read()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Cancel background chores (prefill tails, aborts) at shutdown."""
        tails = self.tails.cancel_all()
        for task in [*self._background, *tails]:
            task.cancel()
        await asyncio.gather(*self._background, *tails, return_exceptions=True)
