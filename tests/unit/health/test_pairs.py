"""Per-pair health: a pair failing while both its servers work with other partners is
quarantined and probed, without opening either server's breaker."""

import asyncio

import httpx
import pytest

from gateway.health.pairs import PairHealth
from tests.unit.fakes import FakeCluster, FakeServer, make_app

P1, P2 = "http://127.0.0.1:30000", "http://127.0.0.1:30002"
D1, D2, D3 = "http://127.0.0.1:30001", "http://127.0.0.1:30003", "http://127.0.0.1:30005"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def healthy_elsewhere(pairs: PairHealth) -> None:
    pairs.record_success("p1", "d2")
    pairs.record_success("p2", "d1")


def test_failures_are_the_pairs_only_when_both_servers_work_with_others():
    clock = Clock()
    pairs = PairHealth(threshold=3, cooldown=10, clock=clock)
    assert pairs.record_failure("p1", "d1") is False  # no evidence yet: the servers' fault
    healthy_elsewhere(pairs)
    assert [pairs.record_failure("p1", "d1") for _ in range(3)] == [True, True, True]
    assert pairs.blocked("p1", "d1") and not pairs.blocked("p1", "d2")
    assert pairs.quarantined() == [("p1", "d1")]


def test_one_servers_evidence_suffices_while_neither_fails_elsewhere():
    """d1 has only ever worked with p1, the prefill it now fails with: p1 working with d2 is
    the evidence. A server failing with every partner is still blamed from its second."""
    pairs = PairHealth(threshold=3, cooldown=10, clock=Clock())
    pairs.record_success("p1", "d2")
    pairs.record_success("p1", "d1")
    assert pairs.record_failure("p1", "d1") is True
    pairs.record_success("p2", "d2")
    dead = PairHealth(threshold=3, cooldown=10, clock=Clock())
    healthy_elsewhere(dead)
    assert dead.record_failure("p1", "d1") is True
    assert dead.record_failure("p2", "d1") is False  # d1 failed with p1 too: d1's fault


def test_quarantine_is_probed_after_the_cooldown_and_cleared_by_a_success():
    clock = Clock()
    pairs = PairHealth(threshold=2, cooldown=10, max_cooldown=40, clock=clock)
    healthy_elsewhere(pairs)
    pairs.record_failure("p1", "d1")
    pairs.record_failure("p1", "d1")
    assert pairs.blocked("p1", "d1")
    clock.now += 10.5
    healthy_elsewhere(pairs)
    assert not pairs.blocked("p1", "d1")  # cooldown over: one probe may go
    pairs.probe("p1", "d1")
    assert pairs.blocked("p1", "d1")  # only one at a time
    assert pairs.record_failure("p1", "d1") is True  # the probe failed: quarantined again
    assert pairs.snapshot()[0]["retry_in"] == pytest.approx(20, abs=0.1)  # doubled
    clock.now += 21
    pairs.probe("p1", "d1")
    pairs.record_success("p1", "d1")
    assert not pairs.blocked("p1", "d1") and pairs.quarantined() == []


def test_old_successes_elsewhere_do_not_count():
    clock = Clock()
    pairs = PairHealth(window=30, clock=clock)
    healthy_elsewhere(pairs)
    clock.now += 31
    assert pairs.record_failure("p1", "d1") is False


def test_a_broken_pair_is_avoided_and_no_breaker_opens():
    def broken_with_p1(body: dict) -> bool:
        return body["bootstrap_port"] == 9001  # P1's bootstrap port: the P1-D1 session

    cluster = FakeCluster({
        P1: FakeServer("prefill", info={"disaggregation_bootstrap_port": 9001}),
        P2: FakeServer("prefill", info={"disaggregation_bootstrap_port": 9002}),
        D1: FakeServer("decode", fail_if=broken_with_p1), D2: FakeServer("decode"),
        D3: FakeServer("decode")})  # 2 x 3: the round-robin policies mix every pairing

    async def go():
        app = make_app(cluster, "--breaker-failures", "3")
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                statuses = [(await client.post("/generate", json={"text": f"t{i}"})).status_code
                            for i in range(40)]
                servers = (await client.get("/admin/servers")).json()
                metrics = (await client.get("/metrics")).text
                return statuses, servers, metrics

    statuses, servers, metrics = asyncio.run(asyncio.wait_for(go(), 30))
    assert statuses == [200] * 40  # every failure was retried on another pair
    assert all(s["breaker"] == "closed" for s in servers["servers"]), servers["servers"]
    [pair] = [p for p in servers["pairs"] if p["quarantined"]]
    assert (pair["prefill"], pair["decode"]) == (P1, D1)
    assert f'gateway_pair_quarantined{{decode="{D1}",prefill="{P1}"}} 1.0' in metrics
    broken = [b for b in cluster.servers[D1].received if b["bootstrap_port"] == 9001]
    # mixing evenly, P1-D1 would get 40 / 6 ~ 7 requests; quarantine stops it at the
    # threshold (3 blamed on the pair) plus the early failures before there was evidence
    assert len(broken) <= 4, len(broken)
    assert len(cluster.servers[D1].received) - len(broken) >= 5  # D1 serves P2 meanwhile
