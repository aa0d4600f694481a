"""How one logical request reaches the servers: through a proxy, or both PD legs sent directly.

`ViaProxy` sends the request to a gateway (ours or a peer), which adds the bootstrap fields and
talks to a prefill and a decode server. `BothLegs` is the floor: the load generator itself does
what a zero-cost proxy would do, sending the same body with a fresh bootstrap room to the prefill
and to a decode server at once and waiting for both answers (decode servers taken in turn).
The simulated servers enforce the PD rules, so the floor is a valid PD request, not a shortcut.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import orjson

from loadtests.client import Connection, post

HOST = "127.0.0.1"
T = TypeVar("T")


def new_rooms() -> Iterator[int]:
    """Bootstrap rooms for one client. They must never repeat across runs: the servers keep
    tombstones of used rooms, so the counter starts at a random 62-bit number."""
    return itertools.count(random.getrandbits(62))


def pd_fields(body: dict, bootstrap_port: int, room: int) -> dict:
    """`body` with what a PD proxy adds: the prefill's bootstrap address and the room."""
    return {**body, "bootstrap_host": HOST, "bootstrap_port": bootstrap_port,
            "bootstrap_room": room}


async def both_legs(prefill_leg: Awaitable[object], decode_leg: Awaitable[T]) -> T:
    """Run both legs of one PD request at once; the decode's answer. A decode that fails (or
    is cancelled) cancels the prefill; a failed prefill fails the call."""
    prefill = asyncio.ensure_future(prefill_leg)
    try:
        answer = await decode_leg
    except BaseException:
        prefill.cancel()
        raise
    await prefill
    return answer


class ViaProxy:
    def __init__(self, port: int, path: str, body: dict) -> None:
        self.port = port
        self.raw = post(HOST, port, path, orjson.dumps(body))

    def session(self) -> ProxySession:
        return ProxySession(self)


class ProxySession:
    def __init__(self, route: ViaProxy) -> None:
        self.raw = route.raw
        self.conn = Connection(HOST, route.port)
        self.first_event: float | None = None  # of the last stream: seconds to its first event

    async def call(self) -> int:
        events, _ = await self.conn.send(self.raw)
        self.first_event = self.conn.first_event
        return events

    def close(self) -> None:
        self.conn.close()


class BothLegs:
    def __init__(self, prefill_port: int, bootstrap_port: int, decode_ports: list[int],
                 path: str, body: dict) -> None:
        self.prefill_port = prefill_port
        self.decode_ports = decode_ports
        self.path = path
        self.bootstrap_port = bootstrap_port
        self.body = body
        self.rooms = new_rooms()
        self.turn = itertools.count()

    def session(self) -> LegsSession:
        return LegsSession(self)


class LegsSession:
    def __init__(self, route: BothLegs) -> None:
        self.route = route
        self.prefill = Connection(HOST, route.prefill_port)
        self.decodes = [Connection(HOST, port) for port in route.decode_ports]
        self.first_event: float | None = None  # of the last stream: seconds to its first event

    async def call(self) -> int:
        route = self.route
        body = orjson.dumps(pd_fields(route.body, route.bootstrap_port, next(route.rooms)))
        decode = self.decodes[next(route.turn) % len(self.decodes)]
        events, _ = await both_legs(
            self.prefill.send(post(HOST, self.prefill.port, route.path, body)),
            decode.send(post(HOST, decode.port, route.path, body)))
        self.first_event = decode.first_event
        return events

    def close(self) -> None:
        self.prefill.close()
        for conn in self.decodes:
            conn.close()
