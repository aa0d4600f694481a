"""`--launch`: a launched server whose restart is ready rejoins with a closed breaker and its
pairs' health forgotten (gateway/launch.py): the quarantine of a pair was the old process's."""

from __future__ import annotations

import pytest

from backends.launcher import ServerState
from gateway.config.settings import GatewayConfig
from gateway.health.pairs import PairHealth
from gateway.launch import LocalCluster
from gateway.servers.pool import ServerPool
from tests.unit.builders import server


@pytest.fixture
def cluster() -> LocalCluster:
    """The default launched cluster (1 prefill, 2 decodes), not started, its servers pooled."""
    pool = ServerPool()
    local = LocalCluster(GatewayConfig(launch=True), pool, None, PairHealth(cooldown=10))
    for handle in local.launcher.servers:
        pool.add(server(handle.url, handle.role))
    return local


def quarantine(pairs: PairHealth, prefill: str, broken: str, working: str) -> None:
    """Three failures of (prefill, broken) while the prefill works with `working`."""
    pairs.record_success(prefill, working)
    for _ in range(3):
        assert pairs.record_failure(prefill, broken)
    assert pairs.blocked(prefill, broken)


def handles(cluster: LocalCluster):
    prefill = next(h for h in cluster.launcher.servers if h.role == "prefill")
    decodes = [h for h in cluster.launcher.servers if h.role == "decode"]
    return prefill, decodes


@pytest.mark.parametrize("restarted", ["prefill", "decode"])
def test_a_restart_ready_again_forgets_its_pairs(cluster: LocalCluster, restarted: str) -> None:
    prefill, (broken, working) = handles(cluster)
    pairs = cluster.pairs
    quarantine(pairs, prefill.url, broken.url, working.url)
    one = prefill if restarted == "prefill" else broken
    cluster._on_state(one, ServerState.CRASHED)
    assert not cluster.pool.get(one.url).healthy
    assert pairs.blocked(prefill.url, broken.url)  # out of rotation: nothing to decide yet
    cluster._on_state(one, ServerState.READY)
    assert cluster.pool.get(one.url).healthy
    assert not pairs.blocked(prefill.url, broken.url)
    assert pairs.quarantined() == []


def test_a_partners_restart_leaves_other_pairs_quarantined(cluster: LocalCluster) -> None:
    """Only the restarted server's pairs start afresh: the decode that works did not change
    the broken pair's sessions by restarting."""
    prefill, (broken, working) = handles(cluster)
    quarantine(cluster.pairs, prefill.url, broken.url, working.url)
    cluster._on_state(working, ServerState.READY)
    assert cluster.pairs.quarantined() == [(prefill.url, broken.url)]


def test_a_crashed_launched_server_stays_out_until_the_launcher_says_ready(
        cluster: LocalCluster) -> None:
    """A health check whose probe was refused still counts a request success from before the
    crash as a good check: the checker marked a crashed server UP while no process listened
    (1.8 s before its restart was ready; 2026-12-07). The launcher's word decides now."""
    import time

    from gateway.health.checker import HealthChecker

    _, (crashed, _) = handles(cluster)
    server = cluster.pool.get(crashed.url)
    server.verified = True
    checker = HealthChecker(cluster.pool, None, endpoint="/health", interval=1, timeout=1,
                            failures=2, successes=1, loads_interval=1)
    since = time.monotonic()
    server.last_success = since + 0.01  # a request answered just before the process died
    cluster._on_state(crashed, ServerState.CRASHED)
    for _ in range(3):
        checker.record(server, False, since)  # refused, yet "a recent success"
        checker.record(server, True)
    assert not server.healthy
    cluster._on_state(crashed, ServerState.READY)
    assert server.healthy and not server.held_out
