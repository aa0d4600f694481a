"""What a prefill counts in flight: the part of the prompt its policy expects uncached there.

Why: the load the policies compare is work to do; counting a cached prefix made a server that
holds a hot document look overloaded, and the guard sent its requests to a cold cache."""

import asyncio

import pytest

from tests.unit.dispatch.test_pd import D1, P1, gateway, run
from tests.unit.fakes import FakeCluster, FakeServer


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


@pytest.mark.parametrize(
    ("policy", "prefill_tokens"),
    [
        pytest.param("cache_aware", 4, id="cache_aware_counts_only_the_uncached_suffix"),
        pytest.param("round_robin", 1004, id="no_prediction_counts_the_whole_prompt"),
    ],
)
def test_prefill_in_flight_tokens_are_the_predicted_uncached_part(policy, prefill_tokens):
    cluster = FakeCluster({P1: FakeServer("prefill", delay=0.05), D1: FakeServer("decode", delay=0.05)})
    ids = list(range(1000))

    async def go():
        async with gateway(cluster, "--prefill-policy", policy) as (client, app):
            pool = {w.role: w for w in app.state.gateway.pool}
            await client.post("/generate", json={"input_ids": ids})
            await until(lambda: pool["prefill"].in_flight == 0)  # its leg may end after decode's
            task = asyncio.create_task(client.post("/generate", json={"input_ids": ids + [7] * 4}))
            await until(lambda: pool["prefill"].in_flight and pool["decode"].in_flight)
            seen = pool["prefill"].in_flight_tokens, pool["decode"].in_flight_tokens
            await task
            await until(lambda: pool["prefill"].in_flight == 0)
            after = pool["prefill"].in_flight_tokens, pool["decode"].in_flight_tokens
            return seen, after

    seen, after = run(go())
    assert seen == (prefill_tokens, 1004)  # the decode holds the whole prompt's KV
    assert after == (0, 0)
