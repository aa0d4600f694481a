"""One PD attempt's data: its pair, rooms, rids and bodies, and what the dispatcher answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from gateway.dispatch.inflight import Tracked, new_id
from gateway.request import RequestView
from gateway.servers.pool import Server


@dataclass(frozen=True)
class Timeouts:
    response: float  # hard limit: a non-streaming answer, or a stream's first chunk
    stream_idle: float  # hard limit of the gap between two streamed chunks
    send: float = 30.0  # how long a client may take to accept one streamed chunk
    tail: float = 30.0  # how long a prefill answer may trail a finished decode
    abort: float = 5.0  # bound of a best-effort /abort_request


@dataclass(eq=False, slots=True)
class Attempt:
    """One dispatch on a pair, with its rooms and rids; `outcome` records what each leg did.

    `rid` is the rid field both legs carry and `rid_list` the rid of every item as the servers
    know it: random, or a client's rid with a random suffix (`unsuffix`, cut from answers),
    so aborting by them can hit nothing else (SGLang aborts by prefix; gateway/dispatch/inflight.py)."""

    view: RequestView
    prefill: Server
    decode: Server
    rooms: int | list[int]
    rid: str | list[str]
    rid_list: tuple[str, ...]
    payload: bytes
    request_id: str
    tracked: Tracked | None = None
    prefill_rank: int | None = None  # the DP rank the prefill leg is steered to
    prefill_payload: bytes = b""  # the prefill leg's body when it differs (routed_dp_rank)
    prefill_target: object = None  # what the policy chose: the prefill Server or its Rank
    # prompt tokens the prefill leg counts in flight: the part the policy expects uncached
    # there (the work it queues; gateway/scheduling/load.py), the whole prompt without a guess
    prefill_tokens: int = 0
    prefill_future: asyncio.Future | None = None  # told (server, rank) or None when done
    policies: dict | None = None  # role -> the policy whose hooks it feeds (ledger.Ledger.opened)
    interrupt: object = None  # cancel.Interrupt of whatever waits on the servers now
    resumable: bool = False  # a broken stream may be continued on another pair
    # set by proxy.Resumed on a resumable stream: what the client got so far (relay.Capture),
    # and where the relay turns when the decode breaks (an async iterator of the rest)
    capture: object = None
    on_broken: Callable | None = None
    unsuffix: bytes | None = None  # the suffix of a client's rid, cut from the answers
    started_at: float = 0.0
    dispatched_at: float = 0.0  # time.monotonic() when its counters were taken (proxy)
    not_after: float = float("inf")  # the request's own deadline (loop time), over retries
    urgency: int = 0  # the request's earlier silences: its deadlines' floor is lower
    progressed: bool = False  # the prefill answered or the decode sent its first byte
    kv_at: float = 0.0  # loop time of the prefill's answer when it was the first progress
    trailing: bool = False  # progressed by its decode, its prefill's answer still to come
    rank_released: bool = False  # the prefill's DP rank no longer counts it (`release_rank`)
    deadline: object = None  # the cancel.Deadline of the first progress
    pair_verdict: str | None = None  # a failure was blamed on "pair" or "server"
    # how each leg ended, as decided (by the leg itself, or by the attempt's deadline before
    # the leg was stopped): what its accounting records when it ends
    verdict: dict[str, bool | None] = field(default_factory=dict)
    outcome: dict[str, bool | None] = field(default_factory=dict)  # the legs accounted
    trace: object = None  # tracing.AttemptTrace with tracing on, else None

    def settle(self, target) -> None:
        """This attempt is done on `target` (a Server or Rank) as far as load goes: the
        target's `/v1/loads` snapshot forgets it (servers.ServerLoad.settle)."""
        target.load.settle(self.dispatched_at, self.view.prompt_tokens)

    def prefill_targets(self) -> tuple:
        """The prefill server, and the DP rank the policy chose there if it chose one."""
        target = self.prefill_target
        if target is None or target is self.prefill:
            return (self.prefill,)
        return (self.prefill, target)

    def settle_prefill(self, trail: bool = False) -> None:
        """`settle` on the prefill server, and on the DP rank the policy chose there.
        `trail`: the prefill leg is still open (its decode answered first), so the server
        may hold the request until it answers: the snapshots asked until then forget it
        too (`ServerLoad.trail`), up to `end_trail`."""
        self.trailing = trail
        for target in self.prefill_targets():
            self.settle(target)
            if trail:
                target.load.trail(self.view.prompt_tokens)
        if trail:  # a leg of its server still, no load (`Server.working`), nor on its rank
            self.prefill.trail(self.prefill_tokens)
            self.release_rank()

    def release_rank(self) -> None:
        """The prefill's DP rank stops counting this attempt in flight (once): as its leg
        ends, or as its decode gets the KV while the prefill's answer is still to come. The
        rank's counters only feed the policies' load, and the rank has computed by then: a
        conversation's next turn sent meanwhile found its rank "busy" with that very turn and
        was moved off its cache. The server keeps counting the leg until it ends (its breaker
        takes the outcome; a drain waits for it)."""
        target = self.prefill_target
        if target is None or target is self.prefill or self.rank_released:
            return
        self.rank_released = True
        target.finish(self.prefill_tokens)

    def end_trail(self) -> None:
        """The prefill leg of a `settle_prefill(trail=True)` ended."""
        self.trailing = False
        self.prefill.trail(self.prefill_tokens, -1)
        for target in self.prefill_targets():
            target.load.trail(self.view.prompt_tokens, -1)


@dataclass(slots=True)
class Answer:
    """The decode's answer: a whole body, or a first chunk plus the rest of the stream."""

    status: int
    content_type: bytes
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], Awaitable[None]] | None = None  # always awaited by the responder


def make_rids(client_rid: object, count: int | None) -> tuple[str | list[str],
                                                            tuple[str, ...], bytes | None]:
    """(the rid field to send, every item's rid on the servers, bytes to cut from answers).

    Without a client rid every item gets a new random rid, per attempt, so a retry never
    meets its predecessor on a server. A client's rid goes upstream with a random suffix:
    SGLang's scheduler aborts by rid PREFIX (`Scheduler.abort_request`, also when a client
    disconnects), so a client rid "a" sent as is would let that client end every request on
    the server whose rid starts with "a". The suffix is cut from the answers again, so
    `meta_info.id` (and OpenAI ids made from it) read as the client's own rid. SGLang turns a
    string rid of a batch into f"{rid}_{i}" (`GenerateReqInput._normalize_rid`)."""
    if client_rid is None:
        if count is None:
            rid = new_id()
            return rid, (rid,), None
        rids = [new_id() for _ in range(count)]
        return rids, tuple(rids), None
    suffix = "-" + new_id()
    if isinstance(client_rid, str):
        sent = client_rid + suffix
        items = (sent,) if count is None else tuple(f"{sent}_{i}" for i in range(count))
        return sent, items, suffix.encode()
    sent_list = [r + suffix for r in client_rid]
    return sent_list, tuple(sent_list), suffix.encode()
