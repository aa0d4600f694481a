"""The prefill's bootstrap server on --bootstrap-port, and the prefill end of the KV channel.

Plain HTTP/1.1 (httptools, keep-alive) with SGLang's public routes, as its
CommonKVBootstrapServer answers them:

    GET  /health            -> OK
    GET  /route?prefill_dp_rank=..&prefill_cp_rank=..&target_tp_rank=..&target_pp_rank=..
    PUT  /route             -> OK
    POST /register_dp_rank  {"bootstrap_room", "dp_rank"} -> OK
    POST /query_dp_ranks    {"bootstrap_rooms": [...]} -> {room: dp_rank} (registered ones)

plus `GET /sim/rooms/{room}` (a room's state, for tests) and `GET /sim/kv`
with `Upgrade: sim-kv/1`, which turns the connection into a decode's KV
channel (wire.py). Each DP rank of the prefill has its own rooms: a decode
joins a room at one rank, and a join without a rank (the decode could not
derive it) waits until the prefill registers the room's rank, as SGLang's
decode polls /query_dp_ranks. A small server of its own rather than a second uvicorn
app: the channel needs the raw connection, and the few routes do not need a
framework.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any
from urllib.parse import parse_qs

import httptools
import orjson

from backends.sim.config import SimConfig
from backends.sim.rooms import Room, RoomRegistry
from backends.sim.wire import CHANNEL_PATH, UPGRADE, BatchWriter, LineReader

_MAX_DP_RANK_ENTRIES = 100_000

ROUTE_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
_TEXT = b"text/plain; charset=utf-8"
_JSON = b"application/json"
_REASONS = {101: "Switching Protocols", 200: "OK", 400: "Bad Request", 404: "Not Found",
            405: "Method Not Allowed", 500: "Internal Server Error"}


def server_info_payload(config: SimConfig) -> dict[str, object]:
    """`PrefillServerInfo` as SGLang's bootstrap server returns it.

    mirrors CommonKVBootstrapServer._handle_route_get/_handle_route_put
    (disaggregation/common/conn.py): dp_size counts the DP ranks, and follow_bootstrap_room
    is whether the prefill's load_balance_method is follow_bootstrap_room.
    """
    return {
        "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": config.num_dp_ranks, "pp_size": 1,
        "page_size": config.page_size, "kv_cache_dtype": "bfloat16",
        "follow_bootstrap_room": config.follow_bootstrap_room,
        "enable_dsa_cache_layer_split": False,
        "enable_kv_cache_sharding": False, "prefill_http_port": config.port,
        "decode_allocation_policy": "early",
    }


class BootstrapServer:
    """Listens on --bootstrap-port in the prefill's event loop."""

    def __init__(self, config: SimConfig, registries: list[RoomRegistry]) -> None:
        self.config = config
        self.registries = registries  # one per DP rank
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self.room_to_dp_rank: OrderedDict[int, int] = OrderedDict()
        self.pending: dict[int, list[tuple[DecodeLink, int, str]]] = {}  # room -> rankless joins

    def register_dp_rank(self, room: int, rank: int) -> None:
        """Remember the rank a prefill request of `room` runs on; rankless joins of it go on.

        mirrors CommonKVBootstrapServer._handle_register_dp_rank (disaggregation/common/conn.py);
        SGLang expires entries after a cleanup interval, the sim keeps the last 100,000.
        """
        table = self.room_to_dp_rank
        table[room] = rank
        table.move_to_end(room)
        while len(table) > _MAX_DP_RANK_ENTRIES:
            table.popitem(last=False)
        for link, tag, rid in self.pending.pop(room, ()):
            link.join_rank(tag, room, rid, rank)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.config.host, self.config.bootstrap_port,
            backlog=4096, reuse_address=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):
                conn.close()
            await self._server.wait_closed()
            self._server = None

    def drop_kv_channels(self) -> None:
        """Close the decodes' KV channels (a role switch tears the prefill KV manager down:
        KVManager.teardown); the bootstrap port itself stays open."""
        for conn in list(self._connections):
            if conn.link is not None:
                conn.close()
        self.pending.clear()

    # ---- routes ----------------------------------------------------------
    def answer(self, method: str, path: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        """(status, content type, body) of one plain HTTP request."""
        if path == "/health":
            return 200, _TEXT, b"OK"
        if path == "/route":
            if method == "PUT":
                return 200, _TEXT, b"OK"
            return self._route(parse_qs(query))
        if path in ("/register_dp_rank", "/query_dp_ranks"):
            if method != "POST":
                return 405, _TEXT, b"Method Not Allowed"
            if path == "/register_dp_rank":
                return self._register(body)
            return self._query_dp_ranks(body)
        if path.startswith("/sim/rooms/") and path[11:].isdigit():
            return self._room_view(int(path[11:]))
        return 404, _TEXT, b"Not Found"

    def _room_view(self, number: int) -> tuple[int, bytes, bytes]:
        """The room's state on the first rank that knows it (tests)."""
        for registry in self.registries:
            room = registry.get(number)
            if room is not None:
                return 200, _JSON, orjson.dumps(room.view())
        if number in self.pending:  # a decode joined without a rank; no prefill registered it yet
            return 404, _JSON, b'{"state":"awaiting_rank"}'
        return 404, _JSON, b'{"state":"unknown"}'

    def _register(self, body: bytes) -> tuple[int, bytes, bytes]:
        try:
            data = orjson.loads(body or b"{}")
            self.register_dp_rank(int(data["bootstrap_room"]), int(data["dp_rank"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            # aiohttp answers a handler's exception with a bare 500
            return 500, _TEXT, b"500 Internal Server Error\n\nServer got itself in trouble"
        return 200, _TEXT, b"OK"

    def _route(self, query: dict[str, list[str]]) -> tuple[int, bytes, bytes]:
        if not all(query.get(k, [""])[0] for k in ROUTE_KEYS):
            return 400, _TEXT, b"Missing inputs for bootstrap server."
        try:
            ranks = [int(query[k][0]) for k in ROUTE_KEYS]
        except ValueError:
            return 400, _TEXT, b"Missing inputs for bootstrap server."
        if ranks == [-1, -1, -1, -1]:
            return 200, _JSON, orjson.dumps(server_info_payload(self.config))
        if ranks[1:] == [0, 0, 0] and 0 <= ranks[0] < self.config.num_dp_ranks:
            return 200, _JSON, orjson.dumps({"rank_ip": self.config.host,
                                             "rank_port": self.config.bootstrap_port})
        text = "Bootstrap info not found for dp_rank={} cp_rank={} tp_rank={} pp_rank={}"
        return 404, _TEXT, text.format(*ranks).encode()

    def _query_dp_ranks(self, body: bytes) -> tuple[int, bytes, bytes]:
        """mirrors _handle_query_dp_ranks: only rooms whose rank was registered."""
        try:
            rooms = orjson.loads(body or b"{}")["bootstrap_rooms"]
            table = self.room_to_dp_rank
            known = {str(int(r)): table[int(r)] for r in rooms if int(r) in table}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return 500, _TEXT, b"500 Internal Server Error\n\nServer got itself in trouble"
        return 200, _JSON, orjson.dumps(known)


class _Connection(asyncio.Protocol):
    """One TCP connection: HTTP/1.1 requests, until it upgrades to a KV channel."""

    def __init__(self, server: BootstrapServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.link: DecodeLink | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._upgrade: bytes | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)
        if self.link is not None:
            self.link.lost()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.link is not None:
            self.link.feed(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._switch(data[exc.args[0]:])
        except httptools.HttpParserError:
            self._write(400, _TEXT, b"Invalid HTTP request.", keep_alive=False)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url, self._body, self._upgrade = b"", [], None

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"upgrade":
            self._upgrade = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade():
            return  # answered by _switch(), once the parser stops at the upgrade
        url = httptools.parse_url(self._url)
        method = self.parser.get_method().decode()
        status, kind, body = self.server.answer(method, url.path.decode(),
                                                (url.query or b"").decode(), b"".join(self._body))
        self._write(status, kind, body, keep_alive=self.parser.should_keep_alive())

    def _switch(self, rest: bytes) -> None:
        """Answer an upgrade: ours becomes a KV channel, any other is refused."""
        path = httptools.parse_url(self._url).path.decode()
        if path != CHANNEL_PATH or (self._upgrade or b"").lower() != UPGRADE:
            self._write(400, _TEXT, b"Unsupported upgrade.", keep_alive=False)
            return
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                             b"Upgrade: " + UPGRADE + b"\r\n\r\n")
        self.link = DecodeLink(self.server, self.transport)
        if rest:
            self.link.feed(rest)

    def _write(self, status: int, kind: bytes, body: bytes, keep_alive: bool) -> None:
        assert self.transport is not None
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\ncontent-length: {len(body)}\r\n"
                f"connection: {'keep-alive' if keep_alive else 'close'}\r\n").encode()
        self.transport.write(head + b"content-type: " + kind + b"\r\n\r\n" + body)
        if not keep_alive:
            self.transport.close()


class DecodeLink:
    """The prefill end of one decode's KV channel: joins, aborts, and KV pushes."""

    def __init__(self, server: BootstrapServer, transport: asyncio.Transport) -> None:
        self.server = server
        self.registries = server.registries
        self.transport = transport
        self.writer = BatchWriter(transport)
        self.reader = LineReader()
        self.joined: dict[int, Room] = {}  # tag -> room joined here whose KV is not sent yet
        self.waiting: dict[int, int] = {}  # tag -> room of a rankless join

    def feed(self, data: bytes) -> None:
        try:
            messages = self.reader.feed(data)
        except ValueError:
            self.transport.close()
            return
        for message in messages:
            self._on_message(message)

    def _on_message(self, message: list[Any]) -> None:
        op, tag = message[0], message[1]
        if op == "join":
            rank = message[4] if len(message) > 4 else 0
            room, rid = int(message[2]), str(message[3])
            if rank is None:  # the decode asks which rank: wait for the prefill's registration
                known = self.server.room_to_dp_rank.get(room)
                if known is None:
                    self.waiting[tag] = room
                    self.server.pending.setdefault(room, []).append((self, tag, rid))
                    return
                rank = known
            self.join_rank(tag, room, rid, int(rank))
        elif op == "abort":
            if tag in self.waiting:
                self._forget_waiting(tag)
                return
            got = self.joined.pop(tag, None)
            if got is not None:
                self.registries[got.dp_rank].fail(got.room, str(message[2]))

    def join_rank(self, tag: int, number: int, rid: str, rank: int) -> None:
        """Take the decode half of `number` at prefill rank `rank`."""
        self.waiting.pop(tag, None)
        if not 0 <= rank < len(self.registries):
            self.writer.send(["refused", tag, (
                f"Could not fetch bootstrap info for: prefill_dp_rank: {rank} prefill_cp_rank: 0 "
                "target_tp_rank: 0 and target_pp_rank 0")])
            return
        got = self.registries[rank].join_decode(number, rid)
        if isinstance(got, str):
            self.writer.send(["refused", tag, got])
            return
        if got is not None:  # None: accepted, but that room's KV already went elsewhere
            self.joined[tag] = got
            got.listeners.append(lambda room: self._room_changed(tag, room))

    def _forget_waiting(self, tag: int) -> None:
        room = self.waiting.pop(tag)
        rest = [p for p in self.server.pending.get(room, []) if p[0] is not self or p[1] != tag]
        if rest:
            self.server.pending[room] = rest
        else:
            self.server.pending.pop(room, None)

    def _room_changed(self, tag: int, room: Room) -> None:
        """Push the KV (or the failure) once the room ends."""
        if not room.terminal or self.joined.pop(tag, None) is None:
            return
        if room.state == "ready":
            self.writer.send(["kv", tag, room.kv])
        else:
            self.writer.send(["failed", tag, room.reason])

    def lost(self) -> None:
        """The decode went away; its rooms run on (SGLang notices only by heartbeat)."""
        for tag in list(self.waiting):
            self._forget_waiting(tag)
        self.joined.clear()

