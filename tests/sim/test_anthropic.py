"""The sim's /v1/messages and count_tokens, as SGLang 0.5.23 serves them (backends/sim/anthropic.py):
PD legs with the routing fields, the shapes of answers, streams and errors."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from tests.sim.simproc import Sim

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "user", "content": "hello"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "two"}]}]
BODY = {"model": "m", "max_tokens": 6, "system": "be brief", "messages": MESSAGES}


async def _both(prefill: Sim, decode: Sim, payload: dict) -> tuple[httpx.Response, ...]:
    async with httpx.AsyncClient(timeout=15) as client:
        return tuple(await asyncio.gather(*(client.post(s.url + "/v1/messages", json=payload)
                                            for s in (prefill, decode))))


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n", 1)
        assert kind.startswith("event: ") and data.startswith("data: ")
        payload = orjson.loads(data[6:])
        assert payload["type"] == kind[7:]
        out.append((kind[7:], payload))
    return out


def test_pd_legs_answer_as_the_plain_server(pd_pair, null_sim, room):
    prefill, decode = pd_pair
    p, d = asyncio.run(_both(prefill, decode, {**BODY, **prefill.pd_fields(room())}))
    want = httpx.post(null_sim.url + "/v1/messages", json=BODY, timeout=15).json()
    assert p.status_code == d.status_code == 200
    got = d.json()
    assert got["type"] == "message" and got["content"][0]["text"] == want["content"][0]["text"]
    assert got["stop_reason"] == "max_tokens" and got["usage"]["output_tokens"] == 6
    assert "stop_sequence" not in got  # exclude_none, as SGLang dumps it


def test_decode_leg_without_routing_fields_is_refused_as_chat_is(pd_pair):
    """The chat handler's 400 (`create_error_response`, type BadRequestError) converted by
    `_convert_openai_error_response`, which keeps a 4xx's own type."""
    _, decode = pd_pair
    r = httpx.post(decode.url + "/v1/messages", json=BODY, timeout=15)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "BadRequestError"
    assert r.json()["error"]["message"]


def test_rid_is_not_carried_to_the_engine(null_sim):
    """`pd_routing_kwargs()` carries the PD fields only: a body's rid never names the item, so
    the same rid twice at once is no duplicate."""
    async def go():
        async with httpx.AsyncClient(timeout=15) as client:
            return await asyncio.gather(*(client.post(
                null_sim.url + "/v1/messages", json={**BODY, "rid": "same"}) for _ in range(2)))

    assert [r.status_code for r in asyncio.run(go())] == [200, 200]


def test_stream_events_in_anthropics_order(null_sim):
    r = httpx.post(null_sim.url + "/v1/messages", json={**BODY, "stream": True}, timeout=15)
    seen = events(r.text)
    kinds = [k for k, _ in seen]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert seen[0][1]["message"]["usage"]["output_tokens"] == 0
    assert seen[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                           "usage": {"output_tokens": 6}}
    assert "[DONE]" not in r.text


@pytest.mark.parametrize(("change", "message"), [
    ({"max_tokens": None}, "max_tokens: Field required"),
    ({"max_tokens": 0}, "max_tokens: Value error, max_tokens must be positive"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
], ids=["no-max-tokens", "zero-max-tokens", "bad-role"])
def test_validation_errors_are_anthropic_400s(null_sim, change, message):
    body = {k: v for k, v in {**BODY, **change}.items() if v is not None}
    r = httpx.post(null_sim.url + "/v1/messages", json=body, timeout=15)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert message in r.json()["error"]["message"]


def test_count_tokens_counts_the_converted_conversation(null_sim):
    def count(body: dict) -> int:
        r = httpx.post(null_sim.url + "/v1/messages/count_tokens", json=body, timeout=15)
        assert r.status_code == 200
        return r.json()["input_tokens"]

    full = count({"model": "m", "system": "be brief", "messages": MESSAGES})
    assert full > count({"model": "m", "messages": MESSAGES}) > count(
        {"model": "m", "messages": MESSAGES[:1]}) > 0
