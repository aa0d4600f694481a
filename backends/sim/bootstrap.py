"""The prefill's bootstrap server (HTTP on the bootstrap port) and the decode's client.

Public routes mimic SGLang's CommonKVBootstrapServer (`GET /health` -> OK,
`GET|PUT /route`, `POST /register_dp_rank`, `POST /query_dp_ranks`). The KV
"transfer" between two sims goes through private routes:

    POST /sim/rooms/{room}/bootstrap  decode takes its half of the room
    GET  /sim/rooms/{room}/kv?wait=S  long-poll until the KV is ready or failed
    POST /sim/rooms/{room}/abort      decode gave up; the room becomes a tombstone
    GET  /sim/rooms/{room}            state of one room (tests)
"""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from backends.sim.config import SimConfig
from backends.sim.job import SimError
from backends.sim.rooms import RoomRegistry

_ROUTE_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
_MAX_POLL = 10.0


def server_info_payload(config: SimConfig) -> dict[str, object]:
    """`PrefillServerInfo` as SGLang's bootstrap server returns it."""
    return {
        "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
        "page_size": config.page_size, "kv_cache_dtype": "bfloat16",
        "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
        "enable_kv_cache_sharding": False, "prefill_http_port": config.port,
        "decode_allocation_policy": "early",
    }


def build_bootstrap_app(config: SimConfig, registry: RoomRegistry) -> Starlette:
    """The Starlette app served on --bootstrap-port by a prefill sim."""

    async def health(_: Request) -> Response:
        return PlainTextResponse("OK")

    async def route(request: Request) -> Response:
        if request.method == "PUT":
            return PlainTextResponse("OK")
        q = request.query_params
        if not all(q.get(k) for k in _ROUTE_KEYS):
            return PlainTextResponse("Missing inputs for bootstrap server.", status_code=400)
        ranks = [int(q[k]) for k in _ROUTE_KEYS]
        if ranks == [-1, -1, -1, -1]:
            return JSONResponse(server_info_payload(config))
        if ranks == [0, 0, 0, 0]:
            return JSONResponse({"rank_ip": config.host, "rank_port": config.bootstrap_port})
        return PlainTextResponse(
            "Bootstrap info not found for dp_rank={} cp_rank={} tp_rank={} pp_rank={}".format(*ranks),
            status_code=404,
        )

    async def register_dp_rank(_: Request) -> Response:
        return PlainTextResponse("OK")

    async def query_dp_ranks(request: Request) -> Response:
        body = await request.json()
        rooms = body.get("bootstrap_rooms", []) if isinstance(body, dict) else []
        return JSONResponse({str(int(r)): 0 for r in rooms if registry.get(int(r)) is not None})

    async def join(request: Request) -> Response:
        number = int(request.path_params["room"])
        body = await request.json()
        got = registry.join_decode(number, str(body.get("rid", "")))
        if isinstance(got, str):
            return JSONResponse({"ok": False, "reason": got}, status_code=409)
        return JSONResponse({"ok": True})

    async def kv(request: Request) -> Response:
        number = int(request.path_params["room"])
        wait = min(float(request.query_params.get("wait", "0")), _MAX_POLL)
        room = registry.get(number)
        if room is not None and not room.terminal and wait > 0:
            await registry.wait_change(room, wait)
            room = registry.get(number)
        return JSONResponse(registry.kv_answer(room))

    async def abort(request: Request) -> Response:
        number = int(request.path_params["room"])
        body = await request.json()
        registry.fail(number, str(body.get("reason") or "Aborted by AbortReq."))
        return JSONResponse({"ok": True})

    async def show(request: Request) -> Response:
        room = registry.get(int(request.path_params["room"]))
        if room is None:
            return JSONResponse({"state": "unknown"}, status_code=404)
        return JSONResponse(room.view())

    return Starlette(routes=[
        Route("/health", health),
        Route("/route", route, methods=["GET", "PUT"]),
        Route("/register_dp_rank", register_dp_rank, methods=["POST"]),
        Route("/query_dp_ranks", query_dp_ranks, methods=["POST"]),
        Route("/sim/rooms/{room:int}/bootstrap", join, methods=["POST"]),
        Route("/sim/rooms/{room:int}/kv", kv),
        Route("/sim/rooms/{room:int}/abort", abort, methods=["POST"]),
        Route("/sim/rooms/{room:int}", show),
    ])


def handshake_failed(rid: str, room: int, reason: str) -> str:
    return (f"Decode handshake failed for request rank=0 decode_req.req.rid={rid!r} "
            f"decode_req.req.bootstrap_room={room} with exception "
            f"KVTransferError(bootstrap_room={room}): {reason}")


def transfer_failed(rid: str, room: int, reason: str) -> str:
    return (f"Decode transfer failed for request rank=0 decode_req.req.rid={rid!r} "
            f"decode_req.req.bootstrap_room={room} with exception "
            f"KVTransferError(bootstrap_room={room}): {reason}")


class _NotABootstrapServer(Exception):
    pass


class BootstrapClient:
    """What a decode sim does against a prefill's bootstrap server."""

    def __init__(self, config: SimConfig, http: httpx.AsyncClient) -> None:
        self.config = config
        self.http = http
        self._known: set[str] = set()  # addresses whose /route answered (SGLang's connection pool)
        self._background: set[asyncio.Task[None]] = set()

    async def handshake(self, addr: str, room: int, rid: str) -> None:
        """Fetch the prefill's info and take the decode half of `room`.

        Unreachable or foreign servers are retried --bootstrap-retries times,
        --bootstrap-retry-interval apart, then fail like SGLang's receiver abort.
        """
        attempts = 0
        while True:
            attempts += 1
            try:
                await self._ensure_route(addr)
                resp = await self.http.post(f"http://{addr}/sim/rooms/{room}/bootstrap",
                                            json={"rid": rid})
                if resp.status_code == 409:
                    raise SimError(500, handshake_failed(rid, room, resp.json().get("reason", "")))
                if resp.status_code != 200:
                    self._known.discard(addr)
                    raise _NotABootstrapServer(resp.status_code)
                return
            except (httpx.HTTPError, _NotABootstrapServer, ValueError):
                if attempts >= self.config.bootstrap_retries:
                    raise SimError(500, handshake_failed(rid, room, "Aborted by AbortReq.")) from None
                await asyncio.sleep(self.config.bootstrap_retry_interval)

    async def _ensure_route(self, addr: str) -> None:
        if addr in self._known:
            return
        resp = await self.http.get(
            f"http://{addr}/route",
            params={k: -1 for k in _ROUTE_KEYS},
        )
        if resp.status_code != 200 or "page_size" not in resp.json():
            raise _NotABootstrapServer(resp.status_code)
        self._known.add(addr)

    async def wait_kv(self, addr: str, room: int, rid: str) -> dict[str, object]:
        """Long-poll the prefill until the KV of `room` is there (or failed)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.config.waiting_timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                elapsed = loop.time() - start
                raise SimError(500, transfer_failed(
                    rid, room, f"Request {room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput"))
            wait = min(remaining, _MAX_POLL)
            try:
                resp = await self.http.get(f"http://{addr}/sim/rooms/{room}/kv",
                                           params={"wait": f"{wait:.3f}"}, timeout=wait + 5.0)
                answer = resp.json()
            except (httpx.HTTPError, ValueError):
                self._known.discard(addr)
                raise SimError(500, transfer_failed(
                    rid, room, f"Lost connection with prefill instance (bootstrap_addr: {addr})")) from None
            if answer.get("state") == "ready":
                return answer
            if answer.get("state") == "failed":
                raise SimError(500, transfer_failed(rid, room, str(answer.get("reason"))))

    def abort_later(self, addr: str, room: int, reason: str) -> None:
        """Tell the prefill this decode gave up on `room` (best effort, not awaited)."""
        task = asyncio.get_running_loop().create_task(self._abort(addr, room, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, addr: str, room: int, reason: str) -> None:
        try:
            await self.http.post(f"http://{addr}/sim/rooms/{room}/abort", json={"reason": reason},
                                 timeout=2.0)
        except httpx.HTTPError:
            pass

