"""kill -9 of a prefill or a decode server under load, three rounds, restarting it each time.

Expected: requests that can be retried (nothing streamed yet) succeed on the healthy pair; a
stream the dead decode had started is continued on the healthy pair, whole; nothing waits
past its deadline; the dead server leaves rotation (admin API and
metrics) and rejoins after its restart; the gateway's memory does not grow round over round.
"""

from __future__ import annotations

import pytest

from tests.rigs.faults import FAST_DETECTION, wait_until
from tests.rigs.load import Load, failures, summary

ROUNDS = 3
CLIENT_DEADLINE = 20.0
GATEWAY_ARGS = (*FAST_DETECTION, "--response-timeout", "10", "--request-timeout", "15")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kill_9_under_load(make_rig, timing, role):
    rig = make_rig(*GATEWAY_ARGS)
    victim = getattr(rig, role)[0]
    rss = [rig.rss_mib()]
    outcomes = []
    for _ in range(ROUNDS):
        with Load(rig.gateway, loops=4, max_new_tokens=32, timeout=CLIENT_DEADLINE) as load:
            load.wait_count(12, since=0, timeout=30)
            killed_at = rig.kill(victim)
            detect = wait_until(lambda: not rig.usable(victim), 10,
                                f"killed {victim.name} leaves rotation")
            load.wait_count(24, since=killed_at, timeout=30)  # the healthy pair serves on
        outcomes += load.outcomes
        timing(f"kill -9 {role}", "out of rotation after", detect)

        metrics = rig.metrics()
        assert metrics.value("gateway_server_usable", server=victim.url) == 0
        breaker = metrics.value("gateway_server_breaker_state", server=victim.url)
        healthy = metrics.value("gateway_server_healthy", server=victim.url)
        assert breaker == 2 or healthy == 0, "out of rotation, by breaker or health check"
        snapshot = rig.snapshot(victim)
        assert snapshot["usable"] is False and snapshot["in_flight"] == 0

        rig.restart(victim)
        back = wait_until(lambda: rig.usable(victim), 10, f"restarted {victim.name} rejoins")
        timing(f"kill -9 {role}", "back in rotation after restart", back)
        rss.append(rig.rss_mib())

    wait_until(lambda: rig.in_flight() == 0, 10, "gateway in-flight counters drain")
    slowest = max(o.elapsed for o in outcomes)
    timing(f"kill -9 {role}", "slowest request", slowest)
    assert slowest < 5, "a request waited on the dead server (they take well under 1 s)"
    bad = failures(outcomes)
    timing(f"kill -9 {role}", "client-visible failures per round", len(bad) / ROUNDS)
    # a prefill's death never reaches a client (a started stream already holds its KV), and
    # a stream the dead decode had started is continued on the other pair (failover)
    assert not bad, summary(outcomes)
    if role == "decode":  # every stream the kill cut (most rounds cut one) went on elsewhere
        m = rig.metrics()
        assert m.total("gateway_stream_failovers_total", outcome="failed") == 0
        assert m.total("gateway_stream_failovers_total", outcome="not_resumable") == 0
    timing(f"kill -9 {role}", "gateway RSS growth, round 1 to 3 (MiB)", rss[-1] - rss[1])
    assert rss[-1] - rss[1] < 5, f"gateway RSS grows round over round (MiB): {rss}"
    assert max(rss) - rss[0] < 15, f"gateway RSS (MiB): {rss}"
    # the requests the kill met were retried; since 2026-12-07 a health check that finds the
    # port refusing takes the server out at once, so fewer requests meet the dead server
    # (retries no longer measure the kill: the per-round checks above do)
