"""The soak's fault knobs: truncated and stalled 200 answers, withheld KV, reused rooms."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.sim.conftest import PD_FLAGS
from tests.sim.simproc import Sim

pytestmark = pytest.mark.timeout(60)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True}
GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}


def read_stream(sim: Sim, path: str, body: dict, timeout: float = 5.0) -> tuple[list[str], str]:
    """The `data:` lines of a streamed answer and how it ended: "done" (closed cleanly),
    "cut" (closed mid-body) or "stalled" (no bytes for `timeout`, the socket still open)."""
    lines: list[str] = []
    buffer = b""
    with httpx.Client(timeout=timeout) as client, client.stream(
            "POST", sim.url + path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        try:
            for chunk in response.iter_raw():
                buffer += chunk
            how = "done"
        except httpx.RemoteProtocolError:
            how = "cut"
        except httpx.ReadTimeout:
            how = "stalled"
    lines = [line for line in buffer.decode().split("\n") if line.startswith("data:")]
    return lines, how


def parses(line: str) -> bool:
    try:
        json.loads(line[len("data: "):])
    except ValueError:
        return False
    return True


def test_truncate_rate_cuts_a_json_answer_and_closes(sim_factory):
    sim = sim_factory("null")
    sim.post("/sim/faults", json={"truncate_rate": 1})
    with httpx.Client(timeout=5) as client, client.stream(
            "POST", sim.url + "/generate", json=GENERATE) as response:
        assert response.status_code == 200
        length = int(response.headers["content-length"])
        got = b""
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in response.iter_raw():
                got += chunk
    assert 0 < len(got) < length
    with pytest.raises(ValueError):
        json.loads(got)
    assert sim.stats()["faults_applied"] == {"truncated": 1}
    sim.post("/sim/faults", json={"truncate_rate": 0})
    assert sim.post("/generate", json=GENERATE).json()["meta_info"]["completion_tokens"] == 8


def test_truncate_rate_cuts_a_stream_mid_json(sim_factory):
    sim = sim_factory("null")
    sim.post("/sim/faults", json={"truncate_rate": 1})
    for _ in range(3):  # 0-3 good chunks first, each time a line cut inside its JSON
        lines, how = read_stream(sim, "/v1/chat/completions", CHAT)
        assert how == "cut"
        assert lines[-1].startswith("data: {") and not parses(lines[-1])
        assert all(parses(line) for line in lines[:-1])
        assert "data: [DONE]" not in lines


def test_truncate_rate_leaves_error_answers_whole(sim_factory):
    sim = sim_factory("null")
    sim.post("/sim/faults", json={"truncate_rate": 1})
    r = sim.post("/v1/chat/completions", json={"messages": "not a list"})
    assert r.status_code == 400 and r.json()["object"] == "error"


def test_stall_after_stops_a_stream_and_keeps_the_socket(sim_factory):
    sim = sim_factory("null")
    sim.post("/sim/faults", json={"stall_after": 2})
    lines, how = read_stream(sim, "/generate", GENERATE, timeout=1.0)
    assert how == "stalled"
    assert len(lines) == 2 and all(parses(line) for line in lines)
    assert sim.stats()["faults_applied"] == {"stalled": 1}


def test_stall_after_sends_a_json_head_and_half_a_body(sim_factory):
    sim = sim_factory("null")
    sim.post("/sim/faults", json={"stall_after": 1})
    with httpx.Client(timeout=1.0) as client, client.stream(
            "POST", sim.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 4}) as response:
        assert response.status_code == 200
        got = b""
        with pytest.raises(httpx.ReadTimeout):
            for chunk in response.iter_raw():
                got += chunk
    assert 0 < len(got) < int(response.headers["content-length"])
    sim.post("/sim/faults", json={"stall_after": 0})
    assert sim.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200


def test_cut_knobs_are_validated(sim_factory):
    sim = sim_factory("null")
    assert sim.post("/sim/faults", json={"truncate_rate": 1.5}).status_code == 400
    assert sim.post("/sim/faults", json={"stall_after": -1}).status_code == 400


def test_withhold_kv_never_answers_while_health_passes(sim_factory, room):
    prefill = sim_factory("prefill", *PD_FLAGS)
    decode = sim_factory("decode", *PD_FLAGS)
    prefill.post("/sim/faults", json={"withhold_kv": True})
    payload = {**GENERATE, **prefill.pd_fields(room())}

    async def run() -> tuple[httpx.Response, bool]:
        async with httpx.AsyncClient(timeout=10) as client:
            p = asyncio.create_task(client.post(prefill.url + "/generate", json=payload))
            d = await client.post(decode.url + "/generate", json=payload)  # --waiting-timeout 1
            still_waiting = not p.done()
            p.cancel()
            return d, still_waiting
    decode_answer, prefill_waiting = asyncio.run(run())
    assert decode_answer.status_code == 500
    assert "WaitingForInput" in decode_answer.json()["message"]
    assert prefill_waiting
    assert prefill.get("/health").status_code == 200
    assert prefill.stats()["faults_applied"] == {"withheld_kv": 1}


def test_a_room_claimed_twice_is_counted_reused(sim_factory, room):
    prefill = sim_factory("prefill", *PD_FLAGS)
    number = room()

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=10) as client:
            first = asyncio.create_task(client.post(
                prefill.url + "/generate", json={**GENERATE, **prefill.pd_fields(number)}))
            await asyncio.sleep(0.3)  # the first owns the room, waiting for its decode
            second = await client.post(
                prefill.url + "/generate", json={**GENERATE, **prefill.pd_fields(number)})
            return [second, await first]
    second, first = asyncio.run(run())
    assert second.status_code == 500 and first.status_code == 500  # no decode ever came
    assert prefill.stats()["rooms_reused"] == 1
    prefill.post("/generate", json={**GENERATE, **prefill.pd_fields(room())}, timeout=10)
    assert prefill.stats()["rooms_reused"] == 1  # a fresh room that timed out is no reuse
