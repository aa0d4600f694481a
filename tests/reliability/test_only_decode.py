"""The only decode of a deployment is marked down while requests are in flight on it, then
comes back: a rescue has nowhere to send their retries, so it leaves them waiting
(gateway/rescue.py `rescue`), and they complete with 200 instead of a wall of 503 "no usable
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

from tests.reliability.load import OK, SHAPES, send, summary
from tests.reliability.rig import FAST_DETECTION, wait_until

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
