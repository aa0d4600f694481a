"""Every fault of the reliability table, with the gateway's DEFAULT flags (docs/RELIABILITY.md).

2 prefills + 2 decodes (simulated, with their normal timing model), clients that give up after
15 s. The goal for each row: with one healthy pair left, no request fails and none waits 15 s;
a stream cut by a dying decode completes on another pair.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from gateway.health.pairs import PairHealth
from tests.rigs.faults import wait_until
from tests.rigs.load import Load, Stream, failures, summary

CLIENT_GIVES_UP = 15.0
LOAD_SECONDS = 12.0  # of traffic while the fault lasts
QUARANTINE_AFTER = PairHealth().threshold  # pair failures in a row, the gateway's default


def run_load_through(rig, fault, seconds: float = LOAD_SECONDS, loops: int = 4):
    """Traffic before, during and after `fault()`; returns (outcomes, when the fault began)."""
    with Load(rig.gateway, loops=loops, max_new_tokens=8, timeout=CLIENT_GIVES_UP) as load:
        load.wait_count(8, since=0, timeout=30)
        at = fault()
        load.wait_count(20, since=at, timeout=40)
        time.sleep(max(0.0, at + seconds - time.monotonic()))
    return load.outcomes, at


def assert_no_client_saw_it(outcomes) -> None:
    assert not failures(outcomes), summary(outcomes)
    slowest = max(o.elapsed for o in outcomes)
    assert slowest < CLIENT_GIVES_UP, f"a request took {slowest:.1f}s"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_hung_server_with_defaults(make_rig, timing, role):
    """SIGSTOP: the kernel accepts connections and nothing answers, /health included."""
    rig = make_rig()
    victim = getattr(rig, role)[0]
    marked: dict = {}

    def freeze() -> float:
        at = rig.freeze(victim)
        marked["down"] = wait_until(lambda: not rig.snapshot(victim)["usable"], 30,
                                    f"the hung {role} leaves rotation")
        return at

    outcomes, at = run_load_through(rig, freeze)
    rig.thaw(victim)
    assert_no_client_saw_it(outcomes)
    during = [o.elapsed for o in outcomes if o.started >= at - 1]
    timing(f"defaults: hung {role} (SIGSTOP)", "out of rotation after", marked["down"])
    timing(f"defaults: hung {role} (SIGSTOP)", "slowest request", max(during))
    timing(f"defaults: hung {role} (SIGSTOP)", "client-visible failures", 0)


def slow_streams(rig, count: int, tokens: int) -> list[Stream]:
    streams = [Stream(rig.gateway, n, tokens) for n in range(count)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(20), "a stream never started"
    return streams


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_decode_dies_or_hangs_mid_stream_with_defaults(make_rig, timing, fault):
    """The streams the decode serves continue on the other pair, whole."""
    rig = make_rig(sim_args=("--token-delay", "0.05"))
    streams = slow_streams(rig, 6, 80)  # 4 s each
    busiest = max(rig.decode, key=lambda s: rig.snapshot(s)["in_flight"])
    assert rig.snapshot(busiest)["in_flight"] >= 1
    at = rig.freeze(busiest) if fault == "hang" else rig.kill(busiest)
    for stream in streams:
        stream.join(40)
    assert all(s.outcome.kind == "ok" for s in streams), [s.outcome for s in streams]
    assert all(s.outcome.elapsed < CLIENT_GIVES_UP for s in streams)
    metrics = rig.metrics()
    assert metrics.total("gateway_stream_failovers_total", outcome="continued") >= 1
    name = "hang after streaming started (SIGSTOP)" if fault == "hang" \
        else "decode killed mid-stream (kill -9)"
    timing(f"defaults: {name}", "last stream complete after", max(s.ended_at for s in streams) - at)
    timing(f"defaults: {name}", "client-visible failures", 0)
    if fault == "hang":
        rig.thaw(busiest)


@pytest.mark.timeout(120)
def test_pair_specific_failures_with_defaults(make_rig, timing):
    """decode0 cannot reach prefill0's transfer session: that pair answers 500, each server
    works with its other partner. The pair is quarantined; no breaker opens; clients see
    nothing."""
    rig = make_rig()
    prefill0, decode0 = rig.prefill[0], rig.decode[0]

    def pair_faults() -> int:  # answers the broken pair gave, as the decode counts them
        return rig.stats(decode0)["faults_applied"].get("pair", 0)

    def break_the_pair() -> float:
        at = rig.fault(decode0, fail_bootstrap_port=prefill0.bootstrap_port)
        # the load picks its pairs by load, so the broken one may take a moment to be tried
        # as often as the quarantine needs: wait for that, not for luck
        wait_until(lambda: pair_faults() >= QUARANTINE_AFTER, 30,
                   f"the broken pair is tried {QUARANTINE_AFTER} times")
        return at

    outcomes, at = run_load_through(rig, break_the_pair)
    assert_no_client_saw_it(outcomes)
    servers = rig.http.get(rig.gateway + "/admin/servers").json()
    opened = {s["url"]: (s["breaker"], s.get("total_failures")) for s in servers["servers"]
              if s["breaker"] != "closed"}
    assert not opened, f"breakers not closed (state, failures): {opened}"
    quarantined = [(p["prefill"], p["decode"]) for p in servers["pairs"] if p["quarantined"]]
    judged = rig.metrics().total("gateway_pair_failures_total")
    assert quarantined == [(prefill0.url, decode0.url)], (
        servers["pairs"], f"pair faults answered {pair_faults()}, judged the pair's {judged}")
    assert rig.metrics().value("gateway_pair_quarantined", prefill=prefill0.url,
                               decode=decode0.url) == 1
    timing("defaults: pair-specific failures", "client-visible failures", 0)


@pytest.mark.timeout(120)
def test_last_decode_half_open_is_not_a_wall_of_503s(make_rig, timing):
    """decode0 hung (down); decode1 answered 500s a moment ago (breaker open, then
    half-open): 30 concurrent requests are served, not refused."""
    rig = make_rig("--breaker-cooldown", "2")  # a short cooldown only to reach half-open soon
    down, flaky = rig.decode
    rig.freeze(down)
    wait_until(lambda: not rig.snapshot(down)["healthy"], 30, "the hung decode is marked down")
    rig.fault(flaky, error_rate=1.0)
    with httpx.Client(timeout=CLIENT_GIVES_UP) as client:
        for _ in range(20):
            client.post(rig.gateway + "/generate", json={"text": "x"})
            if rig.snapshot(flaky)["breaker"] == "open":
                break
    assert rig.snapshot(flaky)["breaker"] == "open"
    rig.fault(flaky, error_rate=0.0)
    time.sleep(2.2)  # the cooldown passes: half-open
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        statuses = list(pool.map(lambda i: httpx.post(
            rig.gateway + "/generate", timeout=CLIENT_GIVES_UP,
            json={"text": f"burst {i}", "sampling_params": {"max_new_tokens": 4}}).status_code,
            range(30)))
    rig.thaw(down)
    assert statuses.count(200) == 30, statuses
    timing("defaults: last decode half-open", "503s out of 30 concurrent", statuses.count(503))


def test_context_overflow_is_refused_at_once_with_defaults(make_rig, timing):
    rig = make_rig(n_prefill=1, n_decode=1, sim_args=("--context-length", "512"))
    received = rig.stats(rig.decode[0])["received"]
    started = time.monotonic()
    r = httpx.post(rig.gateway + "/generate", timeout=CLIENT_GIVES_UP,
                   json={"input_ids": list(range(600)), "sampling_params": {"max_new_tokens": 4}})
    elapsed = time.monotonic() - started
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "600 tokens" in error["message"] and "512" in error["message"]
    text = httpx.post(rig.gateway + "/v1/chat/completions", timeout=CLIENT_GIVES_UP,
                      json={"model": "sim-model", "max_tokens": 8,
                            "messages": [{"role": "user", "content": "word " * 600}]})
    assert text.status_code == 400 and "512" in text.json()["error"]["message"], text.text
    assert rig.stats(rig.decode[0])["received"] == received, "a leg was sent anyway"
    timing("defaults: context overflow", "400 answered after", elapsed)
    json.dumps(error)
