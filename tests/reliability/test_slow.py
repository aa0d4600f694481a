"""A slow server (`first_token_delay` 1 s on every request) is slow, not dead.

Expected with `--policy least_load` (both roles): no request fails or is retried, the slow
server stays healthy with its breaker closed, and most traffic shifts to the fast one because
the slow server holds its requests longer (its in-flight count, the load score, stays higher).
"""

from __future__ import annotations

import pytest

from tests.rigs.faults import FAST_DETECTION
from tests.rigs.load import Load, failures, summary

DELAY = 1.0
GATEWAY_ARGS = (*FAST_DETECTION, "--policy", "least_load", "--response-timeout", "5")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_slow_server_is_not_dead_and_gets_less_traffic(make_rig, timing, role):
    rig = make_rig(*GATEWAY_ARGS)
    slow, fast = getattr(rig, role)
    rig.fault(slow, first_token_delay=DELAY)
    before = rig.metrics()
    with Load(rig.gateway, loops=4, max_new_tokens=8, timeout=20) as load:
        load.wait_count(60, since=0, timeout=60)
        during = rig.snapshot(slow)
    assert not failures(load.outcomes), summary(load.outcomes)
    assert during["healthy"] and during["breaker"] == "closed" and during["usable"]
    after = rig.metrics()
    assert after.total("gateway_retries_total") == 0
    assert after.total("gateway_upstream_failures_total") == 0

    def picked(server) -> float:
        name = "gateway_routing_decisions_total"
        return (after.total(name, role=role, server=server.url)
                - before.total(name, role=role, server=server.url))

    share = picked(fast) / (picked(fast) + picked(slow))
    timing(f"slow {role} ({DELAY:g}s first token)", "share of traffic to the fast one", share)
    assert share >= 0.7, f"least_load sent {share:.0%} to the fast {role}"
    slowest = max(o.elapsed for o in load.outcomes)
    assert DELAY <= slowest < DELAY + 3, "requests on the slow server take the delay, no more"
