"""One PD attempt's data: its pair, rooms, rids and bodies, and what the dispatcher answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from gateway.inflight import Tracked, new_id
from gateway.request import RequestView
from gateway.workers import Worker


@dataclass(frozen=True)
class Timeouts:
    response: float  # hard limit: a non-streaming answer, or a stream's first chunk
    stream_idle: float  # hard limit of the gap between two streamed chunks
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
    interrupt: object = None  # cancel.Interrupt of whatever waits on the servers now
    resumable: bool = False  # a broken stream may be continued on another pair
    started_at: float = 0.0
    progressed: bool = False  # the prefill answered or the decode sent its first byte
    deadline: object = None  # the asyncio.Timeout of the first progress
    pair_verdict: str | None = None  # a failure was blamed on "pair" or "server"
    outcome: dict[str, bool | None] = field(default_factory=dict)


@dataclass
class Answer:
    """The decode's answer: a whole body, or a first chunk plus the rest of the stream."""

    status: int
    content_type: bytes
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], Awaitable[None]] | None = None  # always awaited by the responder


def make_rids(client_rid: object, count: int | None) -> tuple[str | list[str] | None,
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
