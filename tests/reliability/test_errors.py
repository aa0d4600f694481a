"""A server that answers 500 to every generation request (`error_rate=1`), /health still fine.

Expected: each failed leg is retried on another pair (counted in gateway_retries_total), so
clients see nothing; after --breaker-failures consecutive failures the breaker opens
(gateway_server_breaker_state 2) and the server gets no traffic but a few half-open probes
per --breaker-cooldown; once the fault is cleared the next probe succeeds and the breaker closes.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.rigs.faults import FAST_DETECTION, wait_until
from tests.rigs.load import Load, failures, summary

BREAKER_FAILURES = 3
COOLDOWN = 2.0
PROBES = 3  # requests a half-open breaker admits at once (gateway/servers/breaker.py)
GATEWAY_ARGS = (*FAST_DETECTION, "--breaker-failures", str(BREAKER_FAILURES),
                "--breaker-cooldown", str(COOLDOWN))


def breaker_state(rig, server) -> float:
    return rig.metrics().value("gateway_server_breaker_state", server=server.url)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_failing_server_opens_breaker_and_recovers(make_rig, timing, role):
    rig = make_rig(*GATEWAY_ARGS)
    victim = getattr(rig, role)[0]
    received = lambda: rig.stats(victim)["received"]  # noqa: E731
    with Load(rig.gateway, loops=4, max_new_tokens=8) as load:
        load.wait_count(8, since=0, timeout=30)
        rig.fault(victim, error_rate=1.0)
        opened = wait_until(lambda: breaker_state(rig, victim) == 2, 20,
                            f"the failing {role}'s breaker opens")
        timing(f"500s from a {role}", "breaker open after (under load)", opened)
        assert rig.metrics().value("gateway_server_usable", server=victim.url) == 0

        # while open: at most one half-open round of probes (3) per cooldown, nothing else
        count, since = received(), time.monotonic()
        probe = wait_until(lambda: received() > count, COOLDOWN + 10,
                           "a half-open probe after the cooldown")
        assert probe >= COOLDOWN - 0.5, f"probe {probe:.2f}s after opening, cooldown {COOLDOWN}s"
        timing(f"500s from a {role}", "first half-open probe after", probe)
        window = 2 * COOLDOWN + 0.5
        time.sleep(max(0.0, since + window - time.monotonic()))  # observe a fixed window
        probes = received() - count
        assert 1 <= probes <= PROBES * (window / COOLDOWN + 1), f"{probes} requests while open"

        cleared = rig.fault(victim, error_rate=0.0)
        closed = wait_until(lambda: breaker_state(rig, victim) == 0, COOLDOWN + 10,
                            "the breaker closes after the fault is cleared",
                            detail=lambda: (rig.snapshot(victim), rig.stats(victim)["faults"]))
        timing(f"500s from a {role}", "breaker closed after the fault is cleared", closed)
        served = received()
        wait_until(lambda: received() > served + 3, 10, "traffic returns to the server")
        assert time.monotonic() - cleared < COOLDOWN + 10
    assert not failures(load.outcomes), summary(load.outcomes)
    metrics = rig.metrics()
    retried = metrics.total("gateway_retries_total", leg=role, reason="500")
    blamed = metrics.total("gateway_upstream_failures_total", server=victim.url)
    # a first failure with one partner can look like that pair's (the server had just
    # worked with the others): counted for the pair, not the server, and retried all the same
    pair = metrics.total("gateway_pair_failures_total", prefill=victim.url) \
        + metrics.total("gateway_pair_failures_total", decode=victim.url)
    assert blamed >= BREAKER_FAILURES, "the failures that opened it"
    # a request already on the server when its breaker opened is stopped and retried at once
    rescued = metrics.total("gateway_retries_total", leg=role, reason="rescued")
    assert retried + rescued >= blamed + pair, "a failed leg that was not retried"


@pytest.mark.timeout(60)
def test_probe_without_outcome_does_not_wedge_the_breaker(make_rig):
    rig = make_rig(*GATEWAY_ARGS)
    victim, other = rig.decode
    admin = httpx.Client(base_url=rig.gateway, timeout=30)
    assert admin.post("/admin/servers/drain", json={"url": other.url, "timeout": 10}).json()["drained"]
    rig.fault(victim, error_rate=1.0)
    # the only decode fails every attempt: the client gets a 502, the breaker opens
    assert admin.post("/generate", json={"text": "fail"}).status_code == 502
    assert breaker_state(rig, victim) == 2
    rig.fault(victim, error_rate=0.0, first_token_delay=3.0)
    wait_until(lambda: rig.usable(victim), COOLDOWN + 5, "half-open after the cooldown")
    # the probe: its client leaves before the answer, so the decode leg ends without outcome
    with pytest.raises(httpx.ReadTimeout):
        admin.post("/generate", json={"text": "probe"}, timeout=httpx.Timeout(10, read=0.5))
    rig.fault(victim, first_token_delay=0.0)
    wait_until(lambda: admin.post("/generate", json={"text": "again"}).status_code == 200,
               COOLDOWN + 5, "the recovered decode serves again")
