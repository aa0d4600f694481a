"""The context of a /v1/messages prompt is the server's to check (no sockets)."""

import asyncio

from tests.unit.fakes import FakeCluster, FakeServer
from tests.unit.fakes import served_client as gateway

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"


def test_a_budget_past_the_context_is_forwarded_not_refused_unknown():
    """Anthropic clients ask for large `max_tokens` (4096 and more) as a habit. The gateway
    cannot count an Anthropic prompt as SGLang renders it, so rather than a 503 "could not
    count" on every such request, the server decides (its 400 comes back)."""
    info = {"context_length": 100}
    fake = FakeCluster({P1: FakeServer("prefill", info=info),
                        D1: FakeServer("decode", info=info)})

    async def go():
        async with gateway(fake) as client:
            return await client.post("/v1/messages", json={
                "model": "fake", "max_tokens": 4096,
                "messages": [{"role": "user", "content": "hi"}]})

    r = asyncio.run(asyncio.wait_for(go(), 20))
    assert r.status_code == 200, r.text
    assert fake.servers[D1].received and fake.servers[D1].received[0]["max_tokens"] == 4096
