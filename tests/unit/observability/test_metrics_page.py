"""/metrics is rendered once and shared by every scrape for METRICS_COST_RATIO times what the
render took (at most METRICS_TTL).

Rendered on the event loop for every scrape, two tight scrape loops cut the requests a gateway
served from 9,809 to 2,253 in 10 s. The clock here is the caches' own, moved by hand: each
render "takes" RENDER seconds on it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.routes.info import METRICS_COST_RATIO, METRICS_TTL
from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_gateway as gateway
from tests.unit.observability.test_request_metrics import sample
from tests.unit.observability.test_usage import D1, P1

SCRAPES = 20
RENDER = 0.01  # seconds a render takes on the caches' clock
KEPT = min(METRICS_TTL, METRICS_COST_RATIO * RENDER)


class Renders(Collector):
    """Counts the renders of the page, shows the count on it, and moves the clock."""

    def __init__(self, now: list[float], cost: float = RENDER) -> None:
        self.count = 0
        self.now = now
        self.cost = cost

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        self.count += 1
        self.now[0] += self.cost
        yield GaugeMetricFamily("test_render", "which render this page is", value=self.count)


def test_concurrent_scrapes_share_one_render_and_a_later_one_sees_new_values():
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})
    now = [1000.0]

    async def go() -> None:
        async with gateway(cluster) as (client, gw):
            gw.info_caches.clock = lambda: now[0]
            renders = Renders(now)
            gw.metrics.registry.register(renders)
            pages = await asyncio.gather(*(client.get("/metrics") for _ in range(SCRAPES)))
            assert renders.count == 1
            assert {sample_of(page.text) for page in pages} == {1}
            first = requests(pages[0].text)
            assert (await client.post("/generate", json={"text": "hi"})).status_code == 200
            now[0] += KEPT * 0.9  # within the window: the same page
            assert sample_of((await client.get("/metrics")).text) == 1
            now[0] += KEPT * 0.2  # past it: a new page, with the request counted
            page = (await client.get("/metrics")).text
            assert renders.count == 2 and sample_of(page) == 2
            assert requests(page) == first + 1

    run(go())


def test_a_slow_render_is_kept_at_most_metrics_ttl():
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})
    now = [1000.0]

    async def go() -> None:
        async with gateway(cluster) as (client, gw):
            gw.info_caches.clock = lambda: now[0]
            renders = Renders(now, cost=60.0)  # a render "takes" a minute
            gw.metrics.registry.register(renders)
            assert sample_of((await client.get("/metrics")).text) == 1
            now[0] += METRICS_TTL * 0.9
            assert sample_of((await client.get("/metrics")).text) == 1
            now[0] += METRICS_TTL * 0.2
            assert sample_of((await client.get("/metrics")).text) == 2

    run(go())


def sample_of(page: str) -> int:
    """Which render the page came from."""
    line = next(line for line in page.splitlines() if line.startswith("test_render "))
    return int(float(line.split()[1]))


def requests(page: str) -> float:
    try:
        return sample(page, "gateway_requests_total", endpoint="generate", status="200")
    except AssertionError:  # none yet
        return 0.0
