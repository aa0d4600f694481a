"""Injected faults, client disconnects, /abort_request and the /sim/* introspection."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.sim.simproc import Sim, wait_until

pytestmark = pytest.mark.timeout(60)

SLOW = ("--token-delay", "0.05")


def counts(sim: Sim) -> dict[str, int]:
    s = sim.stats()
    return {k: s[k] for k in ("completed", "failed", "cancelled", "aborted", "in_flight")}


def test_stats_shape_and_reset(sim_factory):
    sim = sim_factory("null")
    sim.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
    s = sim.stats()
    assert set(s) >= {"mode", "uptime_s", "requests", "received", "completed", "failed", "cancelled",
                      "aborted", "in_flight", "flush_count", "rooms", "faults", "cache",
                      "kv_events_published"}
    assert s["requests"] == {"/generate": 1} and s["completed"] == 1
    assert sim.post("/sim/reset").json() == {"ok": True}
    assert sim.stats()["requests"] == {} and sim.stats()["completed"] == 0


def test_non_streaming_disconnect_is_cancelled(sim_factory):
    sim = sim_factory("null", *SLOW)
    with pytest.raises(httpx.ReadTimeout):
        sim.post("/generate", json={"text": "slow", "sampling_params": {"max_new_tokens": 100}},
                 timeout=0.3)
    assert wait_until(lambda: counts(sim)["cancelled"] == 1)
    assert counts(sim)["in_flight"] == 0


def test_streaming_disconnect_is_cancelled(sim_factory):
    sim = sim_factory("null", *SLOW)
    with httpx.Client(timeout=10) as client, client.stream(
            "POST", sim.url + "/generate",
            json={"text": "slow", "stream": True, "sampling_params": {"max_new_tokens": 100}}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    assert wait_until(lambda: counts(sim)["cancelled"] == 1)


def test_abort_request_ends_with_finish_reason_abort(sim_factory):
    sim = sim_factory("null", *SLOW)

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=10) as client:
            task = asyncio.create_task(client.post(sim.url + "/generate", json={
                "text": "abort me", "rid": "victim", "sampling_params": {"max_new_tokens": 100}}))
            await asyncio.sleep(0.3)
            assert (await client.post(sim.url + "/abort_request", json={"rid": "victim"})).status_code == 200
            return await task
    r = asyncio.run(run())
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 100
    assert counts(sim)["aborted"] == 1


def test_abort_request_in_stream(sim_factory):
    sim = sim_factory("null", *SLOW)

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=10) as client:
            async def consume() -> list[str]:
                async with client.stream("POST", sim.url + "/generate", json={
                        "text": "abort stream", "rid": "s-victim", "stream": True,
                        "sampling_params": {"max_new_tokens": 100}}) as resp:
                    return [line async for line in resp.aiter_lines() if line.startswith("data:")]
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.3)
            await client.post(sim.url + "/abort_request", json={"rid": "s-victim"})
            return await task
    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["meta_info"]["finish_reason"]["type"] == "abort"


def test_error_rate(sim_factory):
    sim = sim_factory("null", "--error-rate", "1")
    r = sim.post("/generate", json={"text": "x"})
    assert r.status_code == 500 and r.json()["object"] == "error"
    r = sim.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500
    assert sim.post("/sim/faults", json={"error_rate": 0}).json()["error_rate"] == 0
    assert sim.post("/generate", json={"text": "x"}).status_code == 200
    assert counts(sim)["failed"] == 2


def test_hang(sim_factory):
    sim = sim_factory("null", "--hang")
    with pytest.raises(httpx.ReadTimeout):
        sim.post("/generate", json={"text": "x"}, timeout=0.5)
    assert wait_until(lambda: counts(sim)["cancelled"] == 1)
    sim.post("/sim/faults", json={"hang": False})
    assert sim.post("/generate", json={"text": "x"}).status_code == 200


def test_crash_after(sim_factory):
    sim = sim_factory("null", "--crash-after", "2")
    for _ in range(2):
        assert sim.post("/generate", json={"text": "x"}).status_code == 200
    with pytest.raises(httpx.HTTPError):
        sim.post("/generate", json={"text": "x"})
    assert sim.popen.wait(5) != 0


def test_slow_start_and_health_fail(sim_factory):
    sim = sim_factory("null", "--slow-start", "1.0")
    assert sim.get("/health").status_code == 503
    assert wait_until(lambda: sim.get("/health").status_code == 200, timeout=3)
    sim.post("/sim/faults", json={"health-fail": True})
    assert sim.get("/health_generate").status_code == 503
    sim.post("/sim/faults", json={"health_fail": False})
    assert sim.get("/health").status_code == 200
    bad = sim.post("/sim/faults", json={"no_such_knob": 1})
    assert bad.status_code == 400


def test_first_token_delay(sim_factory):
    sim = sim_factory("null", "--first-token-delay", "0.4")
    start = time.monotonic()
    sim.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
    assert time.monotonic() - start >= 0.4


def test_timing_model_defaults(sim_factory):
    sim = sim_factory("null", fast=False)
    start = time.monotonic()
    sim.post("/generate", json={"text": "timing", "sampling_params": {"max_new_tokens": 10}})
    assert time.monotonic() - start >= 0.07  # 5 ms prefill + 9 decode steps of ~7 ms


def test_max_running_requests_queues_fifo(sim_factory):
    sim = sim_factory("null", "--max-running-requests", "1", "--token-delay", "0.05")

    async def run() -> list[float]:
        async with httpx.AsyncClient(timeout=10) as client:
            async def one() -> float:
                start = time.monotonic()
                await client.post(sim.url + "/generate", json={
                    "text": "queue", "sampling_params": {"max_new_tokens": 6}})
                return time.monotonic() - start
            return await asyncio.gather(one(), one())
    times = sorted(asyncio.run(run()))
    assert times[0] >= 0.25  # 5 decode steps of 50 ms
    assert times[1] >= times[0] + 0.2  # the second waited for the first
