"""A prefill answer that trails its decode's (SGLang's prefill often answers after the decode)
does not count as load on its DP rank: the KV is at the decode, the rank has computed.

Why: a conversation's next turn, sent as the previous answer arrives, found the rank holding
the conversation "busy" with that very turn (one in-flight request per trailing turn), and
cache_aware copied the conversation to the idle rank (the 2/3 split of
tests/e2e_sglang/test_dp.py::test_a_growing_conversation_stays_on_its_rank[chat])."""

from __future__ import annotations

import asyncio
import random

from tests.unit.fakes import TRAIL, FakeCluster, FakeServer, chat_answer, chat_turns, run
from tests.unit.fakes import served_gateway as gateway

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
def cluster() -> FakeCluster:
    info = {"dp_size": 2, "load_balance_method": "follow_bootstrap_room"}
    return FakeCluster({P1: FakeServer("prefill", info=info, delay=TRAIL),
                        D1: FakeServer("decode", body=chat_answer)})


def test_a_conversation_whose_prefill_answers_trail_stays_on_its_rank() -> None:
    """Five chat turns back to back, each prefill answer still to come as the next turn is
    routed: every turn goes to the first turn's rank. While a turn's prefill answer trails,
    its rank counts nothing in flight, its server still counts the leg (a drain waits for
    it); once the answers are in, every counter is back to 0 (released once, not twice)."""
    fake = cluster()
    rng = random.Random(3)

    async def go() -> tuple[list[int], list[tuple], tuple]:
        async with gateway(fake, "--prefill-policy", "cache_aware") as (client, gw):
            server = gw.pool.get(P1)
            ranks, seen = [], []

            def note(_turn: int) -> None:
                ranks.append(fake.servers[D1].received[-1]["bootstrap_room"] % 2)
                seen.append((server.in_flight,
                             [(r.in_flight, r.in_flight_tokens) for r in server.ranks]))
            await chat_turns(client, rng, 5, note)
            for _ in range(200):  # the trailing answers come in
                if server.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            end = (server.in_flight, server.in_flight_tokens,
                   [(r.in_flight, r.in_flight_tokens) for r in server.ranks])
            return ranks, seen, end

    ranks, seen, end = run(go())
    assert len(set(ranks)) == 1, ranks
    assert all(ranks_now == [(0, 0), (0, 0)] for _, ranks_now in seen), seen
    assert seen[0][0] == 1  # the server counts its trailing leg
    assert end == (0, 0, [(0, 0), (0, 0)])
