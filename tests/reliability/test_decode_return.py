"""A decode that dies and comes back, with one prefill: back in use within a health check.

Why this case: with a single prefill, every failure of a dead decode is booked on the pair,
never on the decode's breaker (gateway/health/pairs.py: the prefill works with its other
decode, and the dead decode has no partner of its own to prove it at fault), so the pair is
quarantined for its cooldown (10 s). Before the fix, the restarted decode, marked up by its
health checks in half a second, still got no request for the rest of that cooldown: the only
prefill was never paired with it. Now a server its health checks find back (marked up, or
probed again after a restart) ends its pairs' quarantines: the next pick probes the pair.
"""

from __future__ import annotations

import pytest

from tests.rigs.faults import FAST_DETECTION, Rig, wait_until
from tests.rigs.load import Load, failures, summary

PAIR_COOLDOWN = 10.0  # gateway/health/pairs.py's default, which the gateway runs with
BACK_WITHIN = 4.0  # well under the cooldown: a health check, a probe, the first requests


def quarantined(rig: Rig) -> list[tuple[str, str]]:
    response = rig.http.get(rig.gateway + "/admin/servers", headers=rig.admin_headers)
    return [(p["prefill"], p["decode"]) for p in response.json()["pairs"] if p["quarantined"]]


def requests_on(rig: Rig, server) -> int:
    return rig.snapshot(server)["total_requests"]


@pytest.mark.timeout(90)
def test_a_restarted_decode_takes_traffic_again_before_the_pair_cooldown(make_rig, timing):
    rig = make_rig(*FAST_DETECTION, n_prefill=1, n_decode=2)
    prefill, victim = rig.prefill[0], rig.decode[0]
    with Load(rig.gateway, loops=2, max_new_tokens=8, timeout=15) as load:
        load.wait_count(10, since=0, timeout=30)
        # dying: it fails every request while its /health still passes, so its failures
        # are booked on the pair (a kill alone books them there too, but how many meet the
        # dead port before its first refused health check is a race)
        rig.fault(victim, error_rate=1.0)
        wait_until(lambda: (prefill.url, victim.url) in quarantined(rig), 10,
                   "the dying decode's pair is quarantined", detail=lambda: quarantined(rig))
        assert rig.snapshot(victim)["breaker"] == "closed", "booked on the pair, not on it"
        rig.kill(victim)
        wait_until(lambda: not rig.snapshot(victim)["healthy"], 10, "the dead decode is down")
        before = requests_on(rig, victim)
        rig.restart(victim)
        back = wait_until(lambda: requests_on(rig, victim) >= before + 3, 3 * BACK_WITHIN,
                          "the restarted decode serves requests again",
                          detail=lambda: (rig.snapshot(victim), quarantined(rig)))
        timing("decode restarted, one prefill", "serves again after its restart", back)
        assert back < BACK_WITHIN, f"{back:.2f}s: it waited out the pair's cooldown"
        assert quarantined(rig) == [], "its first requests succeeded: the pair is sound"
    # the kill's own requests were retried on the other decode
    assert not failures(load.outcomes), summary(load.outcomes)
