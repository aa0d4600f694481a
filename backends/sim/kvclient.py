"""What a decode sim does against a prefill's bootstrap server.

One `KvLink` (a persistent connection, upgraded to the KV channel of wire.py)
per bootstrap address, shared by every request to that prefill. A request
joins its room over the link and gets a `KvTransfer`, whose future resolves
with the prefill's final word: the KV, a refusal, a failure, the loss of the
connection, or the --waiting-timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import orjson

from backends.sim.bootstrap import ROUTE_KEYS
from backends.sim.config import SimConfig
from backends.sim.deadlines import Deadline, DeadlineQueue
from backends.sim.job import Job, SimError
from backends.sim.wire import CHANNEL_PATH, UPGRADE, BatchWriter, LineReader, take_response

_SETUP_TIMEOUT = 5.0  # connect + /route + upgrade (the old HTTP client's read timeout)
_ROUTE_QUERY = "&".join(f"{k}=-1" for k in ROUTE_KEYS)


def handshake_failed(rid: str, room: int, reason: str) -> str:
    return (f"Decode handshake failed for request rank=0 decode_req.req.rid={rid!r} "
            f"decode_req.req.bootstrap_room={room} with exception "
            f"KVTransferError(bootstrap_room={room}): {reason}")


def transfer_failed(rid: str, room: int, reason: str) -> str:
    return (f"Decode transfer failed for request rank=0 decode_req.req.rid={rid!r} "
            f"decode_req.req.bootstrap_room={room} with exception "
            f"KVTransferError(bootstrap_room={room}): {reason}")


class NotABootstrapServer(Exception):
    """The address answered, but not as a prefill sim's bootstrap server."""


class KvTransfer:
    """One decode item's join: `future` resolves to (kind, payload).

    kind is "kv" (payload: the KV dict), "refused" or "failed" (payload: the
    prefill's reason), "lost" (the connection dropped) or "timeout".
    """

    __slots__ = ("link", "tag", "future", "deadline", "started", "settled")

    def __init__(self, link: KvLink, tag: int, deadlines: DeadlineQueue) -> None:
        self.link, self.tag = link, tag
        self.future: asyncio.Future[tuple[str, Any]] = asyncio.get_running_loop().create_future()
        self.started = time.monotonic()
        self.settled = False  # the prefill said its last word (or the link is gone)
        self.deadline: Deadline = deadlines.add(self._expire)

    def resolve(self, kind: str, payload: Any) -> None:
        self.deadline.cancel()
        if kind != "timeout":
            self.settled = True
        if not self.future.done():
            self.future.set_result((kind, payload))

    def _expire(self) -> None:
        self.link.transfers.pop(self.tag, None)
        self.resolve("timeout", time.monotonic() - self.started)

    def abort(self, reason: str) -> None:
        """The decode gave up: tell the prefill, which fails the room (unless it already ended)."""
        self.deadline.cancel()
        self.link.abort(self.tag, reason)


class KvLink(asyncio.Protocol):
    """A decode's channel to one prefill bootstrap server."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.transport: asyncio.Transport | None = None
        self.transfers: dict[int, KvTransfer] = {}
        self.open = False  # upgraded and not lost
        self._tags = itertools.count()
        self._buffer = bytearray()
        self._answer: asyncio.Future[tuple[int, bytes]] | None = None
        self._reader = LineReader()
        self._writer: BatchWriter | None = None
        self.prefill_dp_size = 1  # from the prefill's PrefillServerInfo (GET /route)
        self.follow_bootstrap_room = True

    # ---- set-up: GET /route, then the upgrade ----------------------------
    async def setup(self) -> None:
        host = self.addr.encode()
        status, body = await self._request(
            f"GET /route?{_ROUTE_QUERY} HTTP/1.1\r\nHost: ".encode() + host + b"\r\n\r\n")
        info = _json_object(body)
        if status != 200 or "page_size" not in info:
            raise NotABootstrapServer(f"GET /route answered {status}")
        self.prefill_dp_size = int(info.get("dp_size", 1) or 1)
        self.follow_bootstrap_room = bool(info.get("follow_bootstrap_room", True))
        status, _ = await self._request(
            f"GET {CHANNEL_PATH} HTTP/1.1\r\nHost: ".encode() + host
            + b"\r\nConnection: Upgrade\r\nUpgrade: " + UPGRADE + b"\r\n\r\n")
        if status != 101:
            raise NotABootstrapServer(f"upgrade answered {status}")
        assert self.transport is not None
        self._writer = BatchWriter(self.transport)
        self.open = True
        rest, self._buffer = bytes(self._buffer), bytearray()
        if rest:
            self._feed(rest)

    async def _request(self, raw: bytes) -> tuple[int, bytes]:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("bootstrap connection closed")
        self._answer = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self._answer

    # ---- asyncio.Protocol ------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.open:
            self._feed(data)
            return
        self._buffer += data
        answer = self._answer
        if answer is None or answer.done():
            return
        try:
            got = take_response(self._buffer)
        except ValueError as exc:
            answer.set_exception(NotABootstrapServer(str(exc)))
            return
        if got is not None:
            self._answer = None
            answer.set_result(got)

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(ConnectionError("bootstrap connection closed"))
        transfers, self.transfers = self.transfers, {}
        for transfer in transfers.values():
            transfer.resolve("lost", None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # ---- the channel -----------------------------------------------------
    def join(self, job: Job, room: int, deadlines: DeadlineQueue) -> KvTransfer:
        """Send the join to the prefill rank that holds the room's KV; from here on the
        job waits for the KV (phase "transfer")."""
        assert self._writer is not None
        transfer = KvTransfer(self, next(self._tags), deadlines)
        self.transfers[transfer.tag] = transfer
        rank = self.prefill_dp_rank(job.spec.disagg_prefill_dp_rank, room)
        if rank == 0:
            self._writer.send(["join", transfer.tag, room, job.spec.rid])
        else:  # None: the prefill answers once it registered the room's rank
            self._writer.send(["join", transfer.tag, room, job.spec.rid, rank])
        job.phase = "transfer"
        return transfer

    def prefill_dp_rank(self, hint: int | None, room: int) -> int | None:
        """The prefill rank of `room`, or None when only the prefill can tell.

        mirrors DecodePreallocQueue._resolve_prefill_dp_rank (disaggregation/decode.py): the
        request's disagg_prefill_dp_rank, 0 for a one-rank prefill, room % dp_size when the
        prefill follows rooms; else SGLang asks /query_dp_ranks until the room is registered.
        """
        if hint is not None:
            return hint
        if self.prefill_dp_size == 1:
            return 0
        if self.follow_bootstrap_room:
            return room % self.prefill_dp_size
        return None

    def abort(self, tag: int, reason: str) -> None:
        self.transfers.pop(tag, None)
        if self.open and self._writer is not None:
            self._writer.send(["abort", tag, reason])

    def _feed(self, data: bytes) -> None:
        try:
            messages = self._reader.feed(data)
        except ValueError:
            self.close()
            return
        for message in messages:
            op, tag = message[0], message[1]
            transfer = self.transfers.pop(tag, None)
            if transfer is not None:  # else that request gave up (and sent its abort)
                transfer.resolve(op, message[2])


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class BootstrapClient:
    """The decode's links, one per prefill bootstrap address, made on first use."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.links: dict[str, KvLink] = {}
        self.deadlines = DeadlineQueue(config.waiting_timeout)
        self._connecting: dict[str, asyncio.Future[KvLink]] = {}

    async def join(self, addr: str, room: int, job: Job) -> KvTransfer:
        """Take the decode half of `room` at the prefill behind `addr`.

        Unreachable or foreign servers are retried --bootstrap-retries times,
        --bootstrap-retry-interval apart, then fail like SGLang's receiver abort.
        """
        attempts = 0
        while True:
            link = self.links.get(addr)
            if link is not None and link.open:
                return link.join(job, room, self.deadlines)
            attempts += 1
            try:
                link = await self._connect(addr)
                return link.join(job, room, self.deadlines)
            except (OSError, NotABootstrapServer, TimeoutError, ValueError):
                if attempts >= self.config.bootstrap_retries:
                    raise SimError(500, handshake_failed(job.spec.rid, room,
                                                         "Aborted by AbortReq.")) from None
                await asyncio.sleep(self.config.bootstrap_retry_interval)

    async def _connect(self, addr: str) -> KvLink:
        """One attempt per address at a time; concurrent joins share it."""
        attempt = self._connecting.get(addr)
        if attempt is None:
            attempt = asyncio.ensure_future(self._open(addr))
            self._connecting[addr] = attempt
            attempt.add_done_callback(lambda _: self._connecting.pop(addr, None))
        return await asyncio.shield(attempt)

    async def _open(self, addr: str) -> KvLink:
        host, port = _split_addr(addr)
        loop = asyncio.get_running_loop()
        link: KvLink | None = None
        try:
            async with asyncio.timeout(_SETUP_TIMEOUT):
                _, link = await loop.create_connection(lambda: KvLink(addr), host, port)
                await link.setup()
        except BaseException:
            if link is not None:
                link.close()
            raise
        old = self.links.get(addr)
        if old is not None:
            old.close()
        self.links[addr] = link
        return link

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
        self.deadlines.close()
