"""count_tokens behind a server that accepts and never answers, over real loopback sockets: the
count is answered by the next server after the silent one's head start
(`tokens/ask_in_turn.HEAD_START_S`, 1 s), not after the count's whole timeout (30 s here;
--probe-timeout in the gateway)."""

from __future__ import annotations

import httpx

from gateway.admission.auth import Auth
from gateway.admission.body_budget import BodyBudget
from gateway.anthropic.endpoint import CountParts, CountTokens
from gateway.servers.pool import Server
from tests.upstream.raw import RawServer, response, run

COUNT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


class OneModel:
    """`Models` of one model served by `decodes` (what CountTokens asks of it)."""

    def __init__(self, decodes: list[Server]) -> None:
        self.decodes = decodes

    def lookup(self, name: str):
        return self, None

    def usable(self, role: str) -> list[Server]:
        return self.decodes if role == "decode" else []


async def silent(conn) -> None:
    await conn.request()
    await conn.closed_by_client.wait()


async def counting(conn) -> None:
    while await conn.request() is not None:
        await conn.send(response(b'{"input_tokens":7}'))


async def two_counts() -> tuple[list, RawServer, RawServer]:
    async with RawServer(silent) as hung, RawServer(counting) as good:
        async with httpx.AsyncClient() as upstream:
            models = OneModel([Server(hung.url, "decode"), Server(good.url, "decode")])
            endpoint = CountTokens(CountParts(Auth((), ()), models, upstream, 30.0, 1 << 20,
                                              BodyBudget(1 << 20)))
            transport = httpx.ASGITransport(app=endpoint)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                answers = [await c.post("/v1/messages/count_tokens", json=COUNT)
                           for _ in range(2)]
        return answers, hung, good


def test_a_silent_server_first_in_line_hands_the_count_to_the_next():
    answers, hung, good = run(two_counts(), timeout=15)
    assert [(r.status_code, r.json()) for r in answers] == [(200, {"input_tokens": 7})] * 2
    assert len(hung.requests) == 1 and b"count_tokens" in hung.requests[0].head  # its turn
    assert len(good.requests) == 2
