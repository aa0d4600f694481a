"""The per-request and per-event metrics the request path writes without calls (children read
from the server's own dict, the gaps' histogram updated inline): the same counts as before."""

from __future__ import annotations

import re

from gateway.sse import DONE, frame
from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_gateway as gateway
from tests.unit.observability.test_usage import D1, P1, settled

EVENTS = 5


def sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one sample: the line of `name` whose labels include `labels`."""
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in /metrics")


def test_decisions_tokens_and_stream_gaps_are_counted_per_request_and_event():
    events = [frame({"text": f"t{i}", "meta_info": {"completion_tokens": i + 1}})
              for i in range(EVENTS)]
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=[*events, DONE])})

    async def go() -> tuple[str, list[str]]:
        async with gateway(cluster) as (client, gw):
            bodies = []
            for _ in range(3):
                r = await client.post("/generate", json={"text": "hi", "stream": True})
                assert r.status_code == 200
                bodies.append(r.text)
            await settled(client, gw)
            return (await client.get("/metrics")).text, bodies

    metrics, bodies = run(go())
    assert all(body.count("data: ") == EVENTS + 1 for body in bodies)
    for role, server in (("prefill", P1), ("decode", D1)):
        assert sample(metrics, "gateway_routing_decisions_total", role=role,
                      server=server) == 3
    prompt = sample(metrics, "gateway_prompt_tokens_total", server=P1)
    assert prompt > 0 and prompt % 3 == 0  # each request's report, added once
    assert sample(metrics, "gateway_cached_tokens_total", server=P1) % 3 == 0
    # one gap per chunk after a stream's first: the fake sends each event as a chunk
    gaps = sample(metrics, "gateway_inter_token_latency_seconds_count", endpoint="generate")
    assert gaps == 3 * EVENTS
    total = sample(metrics, "gateway_inter_token_latency_seconds_sum", endpoint="generate")
    inf = sample(metrics, "gateway_inter_token_latency_seconds_bucket", endpoint="generate",
                 le="+Inf")
    assert inf == gaps and 0 < total < 20
    assert re.search(r'gateway_inter_token_latency_seconds_bucket\{[^}]*le="0\.\d+"', metrics)
