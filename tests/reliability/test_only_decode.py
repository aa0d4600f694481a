"""The only decode of a deployment is marked down while requests are in flight on it, then
comes back: a rescue has nowhere to send their retries, so it leaves them waiting
(gateway/dispatch/rescue.py `rescue`), and they complete with 200 instead of a wall of 503 "no usable
decode server" (seen with real SGLang: its only decode stalled 10 s, /health included).

Two faults: its /health fails while it keeps generating (the `health_fail` knob), and the
whole process stops answering (SIGSTOP) for a little longer than detection takes. Decoding is
slowed (--token-delay) so every request is still in flight when the server is marked down.
"""

from __future__ import annotations

import concurrent.futures
import os

import httpx
import pytest

from tests.rigs.faults import FAST_DETECTION, wait_until
from tests.rigs.load import OK, SHAPES, send, summary

TOKENS = 50
TOKEN_DELAY = 0.1  # every request decodes for about TOKENS * TOKEN_DELAY = 5 s
GATEWAY_ARGS = (*FAST_DETECTION, "--log-level", "info")
CLIENT_TIMEOUT = 40.0


def start_requests(rig, pool: concurrent.futures.ThreadPoolExecutor) -> list:
    """One request of each shape (native and OpenAI, whole and streamed), each on its own
    client; returns their futures (outcomes)."""

    def one(shape: tuple[str, bool]):
        with httpx.Client(timeout=CLIENT_TIMEOUT) as client:
            return send(client, rig.gateway, *shape, f"{os.urandom(6).hex()} alone", TOKENS)

    return [pool.submit(one, shape) for shape in SHAPES]


def mark_down_mid_flight(rig, fault, recover, timing, name: str) -> None:
    decode, prefill = rig.decode[0], rig.prefill[0]
    with concurrent.futures.ThreadPoolExecutor(len(SHAPES)) as pool:
        futures = start_requests(rig, pool)
        # the KV of every request reached the decode: it now only decodes (for about 5 s)
        wait_until(lambda: rig.stats(prefill)["completed"] >= len(SHAPES), 20,
                   "every prefill answered", detail=lambda: rig.stats(prefill))
        fault(decode)
        down = wait_until(lambda: not rig.snapshot(decode)["healthy"], 10,
                          "the only decode is marked down")
        pending = sum(not f.done() for f in futures)
        recover(decode)
        outcomes = [f.result(timeout=CLIENT_TIMEOUT + 5) for f in futures]
    assert [o.kind for o in outcomes] == [OK] * len(SHAPES), (summary(outcomes), outcomes)
    assert pending == len(SHAPES), f"only {pending} requests were in flight when marked down"
    assert rig.stats(decode)["cancelled"] == 0, "a request on the decode was stopped"
    assert rig.stats(decode)["completed"] == len(SHAPES), rig.stats(decode)
    assert "keep waiting on it (no other usable decode server" in rig.gateway_proc.log()
    timing(name, "marked down after", down)
    wait_until(lambda: rig.usable(decode), 10, "the decode is back in rotation")


@pytest.mark.timeout(120)
def test_only_decode_failing_health_keeps_its_requests(make_rig, timing):
    rig = make_rig(*GATEWAY_ARGS, n_prefill=1, n_decode=1,
                   sim_args=("--token-delay", str(TOKEN_DELAY)))
    mark_down_mid_flight(rig, lambda s: rig.fault(s, health_fail=True),
                         lambda s: rig.fault(s, health_fail=False), timing,
                         "/health fails on the only decode")


@pytest.mark.timeout(120)
def test_only_decode_frozen_then_thawed_finishes_its_requests(make_rig, timing):
    rig = make_rig(*GATEWAY_ARGS, n_prefill=1, n_decode=1,
                   sim_args=("--token-delay", str(TOKEN_DELAY)))
    mark_down_mid_flight(rig, rig.freeze, rig.thaw, timing, "SIGSTOP the only decode")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", ["fast", "defaults"])
@pytest.mark.parametrize("fault", ["health_fail", "freeze"])
def test_new_requests_while_the_only_decode_is_marked_down(make_rig, timing, fault, flags):
    """Requests that arrive after the only decode was marked down go to it anyway (panic
    routing past health, gateway/scheduling/scheduler.py) instead of 503 "no usable decode server": with
    /health failing they are served at once; with the process stopped they wait for it and
    finish once it is thawed. With fast detection flags and with the defaults (down after
    two failed checks 2 s apart)."""
    rig = make_rig(*(GATEWAY_ARGS if flags == "fast" else ("--log-level", "info")),
                   n_prefill=1, n_decode=1)
    decode = rig.decode[0]
    for shape in SHAPES:  # the pair works, and its deadlines are learned
        with httpx.Client(timeout=CLIENT_TIMEOUT) as client:
            assert send(client, rig.gateway, *shape, "warm up", 4).kind == OK
    panics_before = rig.metrics().value("gateway_panic_picks_total", role="decode")
    if fault == "health_fail":
        rig.fault(decode, health_fail=True)
    else:
        rig.freeze(decode)
    down = wait_until(lambda: not rig.snapshot(decode)["healthy"], 20,
                      "the only decode is marked down")
    with concurrent.futures.ThreadPoolExecutor(len(SHAPES)) as pool:
        def one(shape: tuple[str, bool]):
            with httpx.Client(timeout=CLIENT_TIMEOUT) as client:
                return send(client, rig.gateway, *shape, f"{os.urandom(6).hex()} later", 8)

        futures = [pool.submit(one, shape) for shape in SHAPES]
        if fault == "freeze":  # every one of them is waiting on the stopped decode
            wait_until(lambda: rig.snapshot(decode)["in_flight"] >= len(SHAPES), 10,
                       "the new requests wait on the stopped decode",
                       detail=lambda: rig.snapshot(decode))
            rig.thaw(decode)
        outcomes = [f.result(timeout=CLIENT_TIMEOUT + 5) for f in futures]
    assert [o.kind for o in outcomes] == [OK] * len(SHAPES), (summary(outcomes), outcomes)
    panics = rig.metrics().value("gateway_panic_picks_total", role="decode") - panics_before
    assert panics >= len(SHAPES), f"{panics} panic picks of the decode"
    if fault == "health_fail":
        rig.fault(decode, health_fail=False)
    timing(f"only decode marked down ({fault}, {flags} flags)", "slowest new request",
           max(o.elapsed for o in outcomes))
    timing(f"only decode marked down ({fault}, {flags} flags)", "marked down after", down)


def work(stats: dict) -> dict:
    """What a simulated server did for requests (its /sim/stats without uptime and faults)."""
    return {key: stats[key] for key in ("requests", "completed", "failed", "cancelled",
                                        "aborted")}


@pytest.mark.timeout(60)
def test_a_killed_only_decode_is_not_panic_routed(make_rig, timing):
    """A server that refuses connections runs nothing: panic routing past health leaves it
    out, so requests get 503 at once and the prefill does no work for them."""
    rig = make_rig(*GATEWAY_ARGS, n_prefill=1, n_decode=1)
    decode, prefill = rig.decode[0], rig.prefill[0]
    with httpx.Client(timeout=CLIENT_TIMEOUT) as client:
        assert send(client, rig.gateway, "/generate", False, "warm up", 4).kind == OK
        rig.kill(decode)
        wait_until(lambda: rig.snapshot(decode)["refused"] and not rig.snapshot(decode)["healthy"],
                   10, "the killed decode is marked down and refusing")
        before = work(rig.stats(prefill))
        outcomes = [send(client, rig.gateway, *shape, "nowhere", 4) for shape in SHAPES]
    assert [o.status for o in outcomes] == [503] * len(SHAPES), outcomes
    assert work(rig.stats(prefill)) == before, "the prefill worked for a request with no decode"
    timing("only decode killed", "slowest 503", max(o.elapsed for o in outcomes))
