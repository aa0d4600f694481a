"""A prefill answer that trails its decode's (SGLang's prefill often answers after the decode)
does not count as load on its prefill server, only as a leg: the KV is at the decode, the
server has computed, but a drain still waits for the answer and the breaker still takes it.

Why: a conversation's next turn, sent as the previous answer arrives, found the server holding
the conversation "busy" with its own earlier turns (one in-flight request per trailing turn),
and cache_aware copied the conversation to the idle server (`spread`), losing its cache: the
DP-rank case of tests/unit/dispatch/test_dp_trailing.py with plain servers."""

from __future__ import annotations

import asyncio
import random

from tests.unit.fakes import TRAIL, FakeCluster, FakeServer, chat_answer, chat_turns, run
from tests.unit.fakes import served_gateway as gateway

P1, P2, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001", "http://127.0.0.1:30002"
def cluster() -> FakeCluster:
    return FakeCluster({P1: FakeServer("prefill", delay=TRAIL),
                        P2: FakeServer("prefill", delay=TRAIL),
                        D1: FakeServer("decode", body=chat_answer)})


def counters(server) -> tuple:
    return (server.totals(), server.working(), server.trailing, server.trailing_tokens)


async def settled(servers, limit: float = 5.0) -> None:
    """Until the trailing prefill answers are in (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while any(s.in_flight for s in servers) and loop.time() < end:
        await asyncio.sleep(0.01)


def test_a_conversation_whose_prefill_answers_trail_stays_on_its_server() -> None:
    """Five chat turns back to back, each earlier turn's prefill answer still to come as the
    next turn is routed: every turn goes to the first turn's server. Meanwhile that server
    counts the trailing legs (totals) but none of them as load (working); once the answers
    are in, every counter is back to 0 (released once, not twice)."""
    fake = cluster()
    rng = random.Random(3)

    async def go() -> tuple[list[int], list[tuple], list[tuple]]:
        async with gateway(fake, "--prefill-policy", "cache_aware") as (client, gw):
            servers = [gw.pool.get(P1), gw.pool.get(P2)]
            seen = []

            def note(_turn: int) -> None:
                seen.append(tuple(counters(s) for s in servers))
            await chat_turns(client, rng, 5, note)
            counts = [s.total_requests for s in servers]
            await settled(servers)
            return counts, seen, [counters(s) for s in servers]

    counts, seen, end = run(go())
    assert sorted(counts) == [0, 5], counts  # before: split 2/3
    holder = counts.index(5)
    legs = [now[holder] for now in seen]
    assert [totals[0] for totals, *_ in legs] == [1, 2, 3, 4, 5], legs  # all still trailing
    assert all(working == (0, 0) for _, working, *_ in legs), legs
    assert end == [((0, 0), (0, 0), 0, 0)] * 2, end


def test_a_drain_waits_for_a_trailing_prefill_leg() -> None:
    """The trailing leg is no load, yet a drain of its server answers only once it ended."""
    fake = cluster()

    async def go() -> tuple[float, float, dict, tuple]:
        async with gateway(fake, "--prefill-policy", "cache_aware") as (client, gw):
            loop = asyncio.get_running_loop()
            answer = await client.post("/v1/chat/completions", json={
                "model": "fake", "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 8})
            assert answer.status_code == 200, answer.text
            server = max(gw.pool.role("prefill"), key=lambda s: s.total_requests)
            url = server.url
            assert server.in_flight == 1 and server.working() == (0, 0), counters(server)
            asked = loop.time()
            drained = await client.post("/admin/servers/drain",
                                        json={"url": url, "timeout": 10})
            took = loop.time() - asked
            since_sent = loop.time() - fake.servers[url].arrivals[0]
            return took, since_sent, drained.json(), counters(server)

    took, since_sent, drained, end = run(go())
    assert drained["drained"] is True, drained
    # it waited for the prefill's answer: the drain's own polling alone takes 0.05 s at most
    assert since_sent >= TRAIL and took > 0.1, (took, since_sent)
    assert drained["server"]["in_flight"] == 0, drained
    assert end == ((0, 0), (0, 0), 0, 0), end
