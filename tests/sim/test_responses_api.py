"""The sim's /v1/responses as SGLang 0.5.23 serves it (backends/sim/responses_api.py): PD legs
with the routing fields, request_id as the rid, the response object, the typed stream, and no
state kept (previous_response_id and background refused, as on a PD server)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import orjson
import pytest

from tests.sim.simproc import Sim

pytestmark = pytest.mark.timeout(60)

BODY = {"model": "m", "input": [{"role": "user", "content": [
    {"type": "input_text", "text": "hello"}]}], "instructions": "be brief",
    "max_output_tokens": 6}


def events(text: str) -> list[dict]:
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n", 1)
        payload = orjson.loads(data.removeprefix("data: "))
        assert kind == "event: " + payload["type"]
        out.append(payload)
    return out


async def _both(prefill: Sim, decode: Sim, payload: dict) -> tuple[httpx.Response, ...]:
    async with httpx.AsyncClient(timeout=15) as client:
        return tuple(await asyncio.gather(*(client.post(s.url + "/v1/responses", json=payload)
                                            for s in (prefill, decode))))


def test_pd_legs_answer_as_the_plain_server(pd_pair, null_sim, room):
    prefill, decode = pd_pair
    body = {**BODY, "request_id": "resp_abc"}
    p, d = asyncio.run(_both(prefill, decode, {**body, **prefill.pd_fields(room())}))
    want = httpx.post(null_sim.url + "/v1/responses", json=BODY, timeout=15).json()
    assert p.status_code == d.status_code == 200
    got = d.json()
    assert got["id"] == "resp_abc" and got["object"] == "response"
    assert got["status"] == "incomplete" and got["output"][0]["type"] == "message"
    assert got["output"][0]["content"][0]["text"] == want["output"][0]["content"][0]["text"]
    assert got["usage"]["output_tokens"] == 6 and "input_tokens_details" in got["usage"]


def test_stream_is_typed_events_without_done(null_sim):
    r = httpx.post(null_sim.url + "/v1/responses", json={**BODY, "stream": True}, timeout=15)
    assert "[DONE]" not in r.text
    got = events(r.text)
    kinds = [e["type"] for e in got]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    text = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == text


@pytest.mark.parametrize("field, value", [("previous_response_id", "resp_1"),
                                          ("background", True)])
def test_state_is_refused_as_without_a_response_store(null_sim, field, value):
    r = httpx.post(null_sim.url + "/v1/responses", json={**BODY, field: value}, timeout=15)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and "Response store is disabled" in error["message"]


def test_request_id_is_the_rid_an_abort_names(sim_factory):
    sim = sim_factory("null", "--token-delay", "0.05", fast=False)
    done: dict = {}

    def run() -> None:
        with httpx.stream("POST", sim.url + "/v1/responses", timeout=30, json={
                **BODY, "max_output_tokens": 400, "stream": True,
                "request_id": "resp_abort_me"}) as r:
            done["text"] = "".join(r.iter_text())

    worker = threading.Thread(target=run)
    worker.start()
    for _ in range(100):
        if httpx.get(sim.url + "/sim/stats", timeout=5).json()["in_flight"]:
            break
        threading.Event().wait(0.05)
    r = httpx.post(sim.url + "/abort_request", json={"rid": "resp_abort_me"}, timeout=5)
    assert r.status_code == 200
    worker.join(15)
    assert not worker.is_alive()
    assert events(done["text"])[-1]["type"] == "response.failed"
