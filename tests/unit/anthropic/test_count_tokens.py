"""/v1/messages/count_tokens spreads its first choice over the decodes, and a decode that never
answers holds a count for its head start (1 s), not for --probe-timeout (no sockets: the fake
servers' transport enforces no timeout, so a count waiting on the hung one would never end)."""

from __future__ import annotations

import asyncio

from tests.unit.fakes import FakeCluster, FakeServer
from tests.unit.fakes import served_client as gateway

P1 = "http://127.0.0.1:30000"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"
COUNT = {"model": "fake", "messages": [{"role": "user", "content": "hello"}]}


def counter(n: int):
    return lambda body: {"input_tokens": n}


def cluster(d1: FakeServer) -> FakeCluster:
    return FakeCluster({P1: FakeServer("prefill"), D1: d1,
                        D2: FakeServer("decode", body=counter(7))})


async def counts(fake: FakeCluster, n: int) -> list:
    async with gateway(fake) as client:
        return [await client.post("/v1/messages/count_tokens", json=COUNT) for _ in range(n)]


def test_counts_take_turns_over_the_decodes():
    fake = cluster(FakeServer("decode", body=counter(5)))
    answers = asyncio.run(asyncio.wait_for(counts(fake, 4), 20))
    assert [r.status_code for r in answers] == [200] * 4
    assert sorted(r.json()["input_tokens"] for r in answers) == [5, 5, 7, 7]
    assert len(fake.servers[D1].received) == len(fake.servers[D2].received) == 2
    assert not fake.servers[P1].received


def test_a_hung_decode_first_in_line_hands_over_to_the_next():
    fake = cluster(FakeServer("decode", hang=True))
    # the default --probe-timeout (10 s) would be the count's wait without the hedge
    answers = asyncio.run(asyncio.wait_for(counts(fake, 2), 8))
    assert [(r.status_code, r.json()) for r in answers] == [(200, {"input_tokens": 7})] * 2
    assert len(fake.servers[D1].received) == 1  # asked first once, its turn
    assert fake.servers[D1].cancelled == 1  # its request ends with the count
