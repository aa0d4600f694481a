"""Two-leg PD dispatch on one (prefill, decode) pair: one attempt, no retries here.

Both legs are sent at once with the same body (plus bootstrap fields). The first failure of
either leg stops the other at once (closing its connection, and asking the server to abort
by request id), so a dead prefill never leaves a decode waiting minutes for KV. Non-streaming
answers are read whole; streams are relayed (gateway/dispatch/relay.py), and the attempt only
"succeeds" once the decode produced its first chunk, so a retry can still happen before the
client has seen anything.

Deadlines: until its first progress (the prefill's answer or the decode's first byte) an
attempt has the deadline learned for its prefill server and prompt size (health/deadlines.py;
shorter after the request's earlier silences: `Attempt.urgency`), kept while it is only
queued (dispatch/first_progress.py), so a hung pair is suspected in seconds and a busy one is
waited for. Attempts are registered on their servers: when one is marked down or its breaker
opens, `rescue` stops its attempts for a retry elsewhere (if the role has another one).

The decode leg runs in the caller's task, the prefill leg in a second one whose failure
interrupts the decode (`Interrupt`, gateway/cancel.py)."""

from __future__ import annotations

import asyncio
import time

import orjson

from gateway.anthropic.stream import head_failure, stream_head
from gateway.cancel import Expired, Interrupt
from gateway.dispatch import rescue
from gateway.dispatch.attempt import Answer, Attempt, Timeouts
from gateway.dispatch.bootstrap_rooms import RoomAllocator
from gateway.dispatch.chores import Chores
from gateway.dispatch.first_progress import first_deadline
from gateway.dispatch.inflight import Tracked
from gateway.dispatch.ledger import Ledger
from gateway.dispatch.leg_bodies import leg_bodies
from gateway.dispatch.prompt_logprobs import StreamMerger, merge_body, prefill_parts
from gateway.dispatch.relay import StreamRelay
from gateway.dispatch.whole_body import read_whole
from gateway.errors import UpstreamError
from gateway.health.deadlines import LatencyModel
from gateway.request import RequestView
from gateway.servers.pool import Server
from gateway.servers.probe import FOLLOW_ROOM
from gateway.timers import Timers
from gateway.tokens.context_check import requested_new_tokens
from gateway.upstream.client import Upstream, UpstreamResponse, leg_error, status_error

__all__ = ["Answer", "Attempt", "PDDispatcher", "Timeouts"]

class _PrefillWatch:
    """Done-callback of the prefill task: a failure interrupts the decode leg's task; a
    success is the attempt's first progress (the KV is on its way)."""

    __slots__ = ("interrupt", "armed", "dispatcher", "attempt")

    def __init__(self, interrupt: Interrupt, dispatcher: PDDispatcher, attempt: Attempt) -> None:
        self.interrupt, self.dispatcher, self.attempt = interrupt, dispatcher, attempt
        self.armed = True

    def __call__(self, prefill: asyncio.Task) -> None:
        error = None if prefill.cancelled() else prefill.exception()  # always retrieved
        self.attempt.prefill.attempts.discard(self.attempt)
        self.dispatcher.chores.tails.ended(prefill)
        if error is None and not prefill.cancelled():
            self.dispatcher.progress(self.attempt, by_prefill=True)
        elif self.armed and error is not None:
            self.armed = False
            self.interrupt.fire(error)


REQUEST_TIMEOUT = "request_timeout"  # UpstreamError.reason: the request's deadline passed


class PDDispatcher:
    """Complete when built: `ledger` accounts each leg once, where the leg ends, and knows
    the servers a rescue may send a retry to."""

    def __init__(self, upstream: Upstream, control: Upstream, rooms: RoomAllocator,
                 timeouts: Timeouts, ledger: Ledger, model: LatencyModel | None = None,
                 timers: Timers | None = None, forward_priority: str = "off") -> None:
        self.upstream = upstream
        self.timers = timers or Timers()
        self.rooms = rooms
        self.timeouts = timeouts
        self.ledger = ledger
        self.model = model or LatencyModel()
        self.forward_priority = forward_priority  # --forward-priority: auto, on, off
        self.suspect_seconds = 10.0  # how long a suspected hang keeps new requests away
        self.chores = Chores(control, self.timers, timeouts)  # aborts, prefill tails
        self.relay = StreamRelay(self.model, timeouts, self.timers, self._stream_ended)

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

    async def run(self, attempt: Attempt, by_policy: bool = False) -> Answer:
        """Send both legs; return the decode answer or raise the first leg failure.
        `by_policy`: the policy chose the prefill (its predicted cache hit is counted)."""
        self.ledger.opened(attempt, by_policy)
        loop = self.timers.loop()  # (cached: asyncio.get_running_loop() is a system call)
        interrupt = attempt.interrupt = Interrupt(loop=loop)
        attempt.started_at = loop.time()
        attempt.prefill.attempts.add(attempt)
        attempt.decode.attempts.add(attempt)
        first = self.model.first_progress_deadline(
            attempt.prefill.url, attempt.view.prompt_tokens, self.timeouts.response, attempt.urgency)
        p_task = loop.create_task(self._prefill_leg(attempt))
        watch = _PrefillWatch(interrupt, self, attempt)
        p_task.add_done_callback(watch)
        response: UpstreamResponse | None = None
        deadline = attempt.deadline = first_deadline(  # kept while the attempt is queued
            self.timers, attempt, first, self.timeouts.response, self._prefill_peers,
            self.model.gaps_of(attempt.decode.url), self.model.options.floor)
        try:
            response, answer = await self._decode_leg(attempt)
            self.progress(attempt)
            attempt.decode.last_success = time.monotonic()  # alive: it is answering
            watch.armed = False
            merger = await self._merge(attempt, p_task, response, answer) \
                if attempt.view.logprob_merge else None
            if response is not None:
                self._hand_over(attempt, response, answer, merger, p_task)
                response = p_task = None  # the relay's now
            return answer
        except asyncio.CancelledError:
            if (reason := interrupt.reason()) is None:
                raise
            raise self._stopped(attempt, reason, p_task, first, loop.time()) from None
        except UpstreamError:
            rescue.suspect_if_hung(attempt, loop.time(), first, self.suspect_seconds)
            raise
        finally:
            watch.armed = False
            deadline.cancel()
            attempt.deadline = None
            interrupt.close()
            if p_task is not None:  # not handed over: the decode leg ends here
                attempt.decode.attempts.discard(attempt)
                attempt.prefill.attempts.discard(attempt)
                self._settle(attempt, p_task, response)

    async def _merge(self, attempt: Attempt, p_task: asyncio.Task,
                     response: UpstreamResponse | None, answer: Answer) -> StreamMerger | None:
        """Prompt logprobs asked: the prefill's merged into a whole answer, or the merger
        of a stream's events."""
        parts = prefill_parts(attempt.view.endpoint, await p_task)
        if response is None:
            answer.body = merge_body(attempt.view.endpoint, answer.body, parts)
            return None
        return StreamMerger(attempt.view.endpoint, parts)

    def _hand_over(self, attempt: Attempt, response: UpstreamResponse, answer: Answer,
                   merger: StreamMerger | None, p_task: asyncio.Task) -> None:
        """The stream goes to the relay; the decode leg ends when the stream does."""
        answer.stream = self.relay.stream(attempt, response, answer.body, merger, p_task)
        answer.body = b""
        answer.close = self.relay.closer(attempt, response, p_task, answer.stream)
        attempt.prefill.attempts.discard(attempt)  # it now waits on the decode only

    def progress(self, attempt: Attempt, by_prefill: bool = False, moved: bool = True) -> None:
        """The pair works (prefill answered, or the decode's first byte): learn how long it
        took. Once its prefill answered (the KV is there: a silent decode now is a hung one)
        a stream must see its first chunk within the decode's learned gap deadline, a whole
        answer within its learned time per token (`answer_deadline`). `moved` False: the
        caller moves the deadline itself at once (`read_whole`), so it is not moved twice."""
        if attempt.progressed:
            return
        attempt.progressed = True
        # the prefill has computed, though its HTTP answer may come after the decode's (CPU
        # rig): its snapshot forgets the request now (a conversation's next turn sent
        # meanwhile found the prefill "busy"), and an n > 1 request's other samples may follow
        if "prefill" not in attempt.outcome:  # else settled as the leg ended (ledger)
            attempt.settle_prefill(trail=True)
        _placed(attempt, True)
        now = self.timers.loop().time()
        self.model.first_progress(attempt.prefill.url, attempt.view.prompt_tokens,
                                  now - attempt.started_at)
        if attempt.deadline is not None and moved:
            limit = attempt.started_at + self.timeouts.response
            if by_prefill:  # the decode's own silence from now on is bounded by what it learned
                attempt.kv_at = now
                url, hard, urgent = attempt.decode.url, self.timeouts.response, attempt.urgency
                limit = min(limit, now + (
                    self.model.gap_deadline(url, hard, urgent) if attempt.view.stream else
                    self.model.answer_deadline(url, requested_new_tokens(attempt.view), hard,
                                               urgent)))
            attempt.deadline.move(min(limit, attempt.not_after))

    def _prefill_peers(self) -> list[Server] | None:
        return self.ledger.peers_of("prefill")

    def _stopped(self, attempt: Attempt, reason: BaseException, p_task: asyncio.Task,
                 first: float, now: float) -> BaseException:
        """What to raise for the interrupt that stopped the attempt's wait: its deadline
        passed, the prefill failed, or a rescue stopped it."""
        if isinstance(reason, Expired):
            return self._expired(attempt, p_task, first, now)
        if isinstance(reason, UpstreamError):
            rescue.suspect_if_hung(attempt, now, first, self.suspect_seconds)
        return reason

    def _expired(self, attempt: Attempt, p_task: asyncio.Task, first: float,
                 now: float) -> UpstreamError:
        """No answer in time. Each leg still waiting is a suspect (a hung decode keeps its
        prefill waiting too, and the reverse): both feed their breakers and both are avoided
        by the retry. The request's own deadline passing is no server's fault. The verdicts
        are accounted as each leg ends (stopped now)."""
        verdict = attempt.verdict
        if now >= attempt.not_after - self.timers.resolution:
            for leg in ("prefill", "decode"):
                verdict.setdefault(leg, None)
            return UpstreamError("the request's deadline passed", leg="both",
                                 server_url=attempt.prefill.url, retryable=False, status=504,
                                 reason=REQUEST_TIMEOUT)
        if not attempt.progressed:  # a suspected hang: its cohort on the pair too
            rescue.pair_cohort(attempt)
            rescue.suspect_if_hung(attempt, now, first, self.suspect_seconds)
        elif "prefill" in verdict:
            rescue.decode_hung(attempt, self.suspect_seconds,  # KV there, decode silent
                               self.ledger.peers_of("decode"))
        late = [leg for leg in ("prefill", "decode") if leg not in verdict]
        if "decode" in late and p_task.done():
            late = ["decode"]
        for leg in late:
            verdict[leg] = False
        servers = " and ".join(
            f"{leg} server {(attempt.prefill if leg == 'prefill' else attempt.decode).url}"
            for leg in late) or "the pair"
        leg = late[0] if len(late) == 1 else "both"
        url = attempt.decode.url if leg == "decode" else attempt.prefill.url
        limit = (f"its deadline (at most {self.timeouts.response:g}s; learned from its "
                 "speed once its KV was there or its answer began)" if attempt.progressed
                 else f"{first:.3g}s (the deadline learned for this server and prompt size)")
        return UpstreamError(f"{servers} gave no answer within {limit}",
                             leg=leg, server_url=url, retryable=True, status=504)

    def _settle(self, attempt: Attempt, p_task: asyncio.Task,
                response: UpstreamResponse | None) -> None:
        """After a failure or a whole answer: stop what still runs; the decode leg ends."""
        if response is not None:  # a stream opened but never handed to a relay
            response.abort()
        decided = "decode" in attempt.verdict  # else it was stopped from outside
        ok = attempt.verdict.setdefault("decode", None)
        self.ledger.leg_done(attempt, "decode", ok)
        if not decided:
            self.chores.abort(attempt.decode, attempt.rid_list)
        if not p_task.done():
            if ok is True and response is None:
                self.chores.finish_tail(attempt, p_task)
            else:
                p_task.cancel()
                self.chores.abort(attempt.prefill, attempt.rid_list)

    def _stream_ended(self, attempt: Attempt, response: UpstreamResponse,
                      p_task: asyncio.Task, ok: bool | None) -> None:
        """The relayed stream ended (`ok` None: the client left), or was closed before it
        started: the decode leg ends. Idempotent."""
        if "decode" in attempt.outcome:
            return
        if ok is not True:
            response.abort()
        attempt.decode.attempts.discard(attempt)
        self.ledger.leg_done(attempt, "decode", ok)
        if not p_task.done():
            self.chores.finish_tail(attempt, p_task)
        if ok is None:  # the client went away mid-stream
            self.chores.abort(attempt.decode, attempt.rid_list)

    # -- the legs ----------------------------------------------------------------------------

    async def _open(self, attempt: Attempt, leg: str, server: Server) -> UpstreamResponse:
        """The leg's response, its head read; an error status raised. The caller wraps it
        and the body's reading in one `try` whose errors go through `leg_error`."""
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
            try:
                response = await self._open(attempt, "prefill", attempt.prefill)
                body = await response.read()
            except Exception as exc:  # noqa: BLE001 - named for the leg, or raised as it is
                raise leg_error("prefill", attempt.prefill.url, exc)  # noqa: B904
            response = None
            ok = True
            self.ledger.prefill_answered(attempt, body)
            return body
        except UpstreamError as exc:
            ok = False if exc.retryable else None
            # computed if a whole answer (its head comes with its body) or once the decode
            # works; a stream's head comes at once (docs/RELIABILITY.md, fixed bugs)
            if response is not None and not attempt.view.logprob_merge and \
                    (attempt.progressed or not attempt.view.stream):
                return b""
            raise
        finally:
            if response is not None:
                response.abort()
            # the leg's own outcome, unless the attempt's deadline gave one as it stopped it
            self.ledger.leg_done(attempt, "prefill", attempt.verdict.setdefault("prefill", ok))
            _placed(attempt, ok)

    async def _decode_leg(self, attempt: Attempt) -> tuple[UpstreamResponse | None, Answer]:
        """Non-streaming: the whole body (response None). Streaming: the open response and
        its first chunk in `answer.body`. The leg's outcome is decided here, accounted where
        the leg ends (`_settle`, or `_stream_ended` for a relayed stream)."""
        response = None
        try:
            try:
                response = await self._open(attempt, "decode", attempt.decode)
                content_type = response.header(b"content-type") or b"application/json"
                if not attempt.view.stream:  # its answer began: bounded by its gaps now,
                    self.progress(attempt, moved=False)  # as read_whole moves the deadline
                    body = await read_whole(attempt, response, self.model, self.timeouts,
                                            self.timers.loop())
                    if attempt.unsuffix is not None:
                        body = body.replace(attempt.unsuffix, b"")
                    response = None
                    attempt.verdict["decode"] = True
                    return None, Answer(200, content_type, body)
                first = await stream_head(response, attempt.view, attempt.decode.url)
            except Exception as exc:  # noqa: BLE001 - named for the leg, or raised as it is
                raise leg_error("decode", attempt.decode.url, exc)  # noqa: B904
            failure = head_failure(first, attempt.view) if first else None
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
            attempt.verdict.setdefault("decode", False if exc.retryable else None)
            raise
        finally:
            if response is not None:
                response.abort()

    async def close(self) -> None:
        """Cancel background chores (prefill tails, aborts) at shutdown."""
        await self.chores.close()


def _placed(attempt: Attempt, ok: bool | None) -> None:
    """Tell the other samples of an n > 1 request (parallel_samples.Placement) where the
    first one's prompt got cached: its prefill and rank, or None when that prefill failed.
    The first word counts: the first progress, or the prefill leg's end."""
    future = attempt.prefill_future
    if future is not None and not future.done():
        future.set_result((attempt.prefill, attempt.prefill_rank) if ok else None)
