"""Faults on top of faults, with the gateway's DEFAULT flags (docs/RELIABILITY.md, "Trust
under compound faults"): a server recovering while another breaks."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.rigs.faults import wait_until
from tests.rigs.load import Load, failures, summary

CLIENT_GIVES_UP = 15.0


def chat(gateway: str, i: int) -> tuple[int | str, float]:
    started = time.monotonic()
    try:
        r = httpx.post(gateway + "/v1/chat/completions", timeout=CLIENT_GIVES_UP, json={
            "messages": [{"role": "user", "content": f"question {i} " * 10}], "max_tokens": 8})
        r.json()
        return r.status_code, time.monotonic() - started
    except (httpx.HTTPError, ValueError) as exc:
        return type(exc).__name__, time.monotonic() - started


@pytest.mark.timeout(180)
def test_the_other_decode_hangs_while_one_recovers_from_a_500_storm(make_rig, timing):
    """decode0 answers 500 to 200 requests (all retried), heals; a second later decode1 hangs
    (SIGSTOP: connection open, no bytes, /health too). decode0's breaker is still open, but
    its health checks pass: the requests on the hung decode1 are retried there."""
    rig = make_rig()
    recovering, hung = rig.decode
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        rig.fault(recovering, error_rate=1.0)
        storm = list(pool.map(lambda i: chat(rig.gateway, i), range(200)))
        assert [s for s, _ in storm].count(200) == 200, storm
        assert rig.snapshot(recovering)["breaker"] != "closed"
        rig.fault(recovering, error_rate=0.0)
        time.sleep(1.0)
        at = rig.freeze(hung)
        after = list(pool.map(lambda i: chat(rig.gateway, 1000 + i), range(60)))
    rig.thaw(hung)
    bad = [(status, round(took, 1)) for status, took in after
           if status != 200 or took >= CLIENT_GIVES_UP]
    assert not bad, bad
    slowest = max(took for _, took in after)
    timing("compound: decode hangs while the other recovers from 500s", "slowest of 60",
           slowest)
    timing("compound: decode hangs while the other recovers from 500s", "client failures", 0)
    assert time.monotonic() - at < 120


@pytest.mark.timeout(180)
def test_a_prefill_hangs_while_a_decode_is_down(make_rig, timing):
    """decode0 is killed; while it is out, prefill0 hangs (SIGSTOP). One pair is left
    (prefill1, decode1): every request is served there, none fails."""
    rig = make_rig()
    prefill0, decode0 = rig.prefill[0], rig.decode[0]
    with Load(rig.gateway, loops=6, max_new_tokens=8, timeout=CLIENT_GIVES_UP) as load:
        load.wait_count(8, since=0, timeout=30)
        rig.kill(decode0)
        wait_until(lambda: not rig.snapshot(decode0)["usable"], 30, "the killed decode is out")
        at = rig.freeze(prefill0)
        load.wait_count(40, since=at, timeout=60)
    rig.thaw(prefill0)
    outcomes = load.outcomes
    assert not failures(outcomes), summary(outcomes)
    during = [o.elapsed for o in outcomes if o.started >= at - 1]
    assert max(during) < CLIENT_GIVES_UP, summary(outcomes)
    timing("compound: prefill hangs while a decode is down", "slowest request", max(during))
