"""A server restarted with other facts (here another `--dp-size`) is learned again: after a
health check that found it refusing connections, or a `/v1/loads` answer listing another
number of DP ranks (a restart between two checks). Before, the ranks of its first probe stayed
for good, and rooms were steered to ranks it no longer had."""

from __future__ import annotations

import asyncio

import httpx

from gateway.health.checker import HealthChecker
from gateway.servers.pool import Server, ServerPool
from gateway.servers.probe import ServerFacts

URL = "http://127.0.0.1:30000"


class Restarting:
    """A prefill at URL answering as a server of `dp` ranks, or refusing connections."""

    def __init__(self, dp: int) -> None:
        self.dp, self.down, self.probed, self.port = dp, False, 0, 8998

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("refused", request=request)
        path = request.url.path
        if path == "/server_info":
            self.probed += 1
            return httpx.Response(200, json={"disaggregation_mode": "prefill",
                                             "disaggregation_bootstrap_port": self.port,
                                             "served_model_name": "m", "dp_size": self.dp})
        if path == "/v1/loads":
            return httpx.Response(200, json={"loads": [
                {"dp_rank": r, "num_running_reqs": 0} for r in range(self.dp)]})
        return httpx.Response(200)


def run(server_dp: int, scenario, given_port: int | None = None) -> Server:
    server = Server(URL, "prefill", given_port)
    server.apply_facts(ServerFacts("prefill", 8998, "m", 2))
    server.healthy = True
    fake = Restarting(server_dp)

    async def go() -> None:
        pool = ServerPool()
        pool.add(server)
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
            checker = HealthChecker(pool, client, endpoint="/health", interval=1, timeout=5,
                                    failures=3, successes=2, loads_interval=0)
            await scenario(checker, server, fake)

    asyncio.run(go())
    return server


def test_a_server_that_refused_a_check_is_probed_again_before_it_serves() -> None:
    async def scenario(checker, server, fake) -> None:
        fake.down = True
        assert not await checker.check(server)
        assert not server.serving  # nothing listens: out of rotation until probed again
        fake.down, fake.dp = False, 4  # back, with another --dp-size
        assert await checker.check(server)

    server = run(2, scenario)
    assert server.serving and server.dp_size == 4 and len(server.ranks) == 4


def test_a_loads_answer_with_another_rank_count_probes_the_server_again() -> None:
    async def scenario(checker, server, fake) -> None:
        await checker._load_of(server)

    server = run(1, scenario)  # restarted with --dp-size 1 between two checks
    assert server.serving and server.dp_size == 1 and server.ranks == []


def test_the_same_rank_count_probes_nothing() -> None:
    probes = []

    async def scenario(checker, server, fake) -> None:
        await checker._load_of(server)
        assert await checker.check(server)
        probes.append(fake.probed)

    run(2, scenario)
    assert probes == [0]


def test_with_skip_probe_nothing_is_probed() -> None:
    """--skip-probe: the operator's servers may have no /server_info; a refused check leaves
    them verified (they come back with the health checks alone)."""
    server = Server(URL, "prefill")
    server.apply_facts(ServerFacts("prefill", 8998, "m", 2))
    fake = Restarting(2)

    async def go() -> None:
        pool = ServerPool()
        pool.add(server)
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
            checker = HealthChecker(pool, client, endpoint="/health", interval=1, timeout=5,
                                    failures=3, successes=2, loads_interval=0, reprobe=False)
            fake.down = True
            await checker.check(server)
            fake.down, fake.dp = False, 4
            await checker._load_of(server)

    asyncio.run(go())
    assert server.verified and fake.probed == 0


def test_a_restart_on_another_bootstrap_port_is_learned() -> None:
    """The port was read from /server_info, not given: a prefill restarted on another one
    (a launcher's free port) must get decodes sent to the new one. Before, the first port
    stayed: every request through it failed its KV handshake and was retried elsewhere, and
    the prefill stayed out (its pairs quarantined, its breaker open) for good."""
    async def scenario(checker, server, fake) -> None:
        fake.down = True
        await checker.check(server)
        fake.down, fake.port = False, 28523
        assert await checker.check(server)

    assert run(2, scenario).bootstrap_port == 28523


def test_a_bootstrap_port_the_operator_gave_is_kept() -> None:
    """`--prefill URL PORT`: the operator's port wins over what the server says (a port
    mapped between the decodes and the prefill)."""
    async def scenario(checker, server, fake) -> None:
        fake.down = True
        await checker.check(server)
        fake.down, fake.port = False, 28523
        assert await checker.check(server)

    assert run(2, scenario, given_port=9100).bootstrap_port == 9100
