"""What a stream keeps for a continuation is bounded (gateway/dispatch/relay.py `CAPTURE_LIMIT`):
past the bound nothing is kept and a broken stream ends with an error event, not a
continuation built from part of what the client was sent."""

from __future__ import annotations

import json

import pytest

from gateway.dispatch import relay
from tests.unit.dispatch.test_failover import D2, cluster, native
from tests.unit.fakes import run
from tests.unit.fakes import served_gateway as gateway


def _broken_stream() -> tuple[str, list[dict]]:
    dying = [native(" a", [11]), native(" a b", [11, 12]), b"<error>"]
    rest = [native(" c", [13], {"type": "length"}), b"data: [DONE]\n\n"]
    fake = cluster(dying, rest)

    async def go() -> str:
        async with gateway(fake) as (client, _gw):
            r = await client.post("/generate", json={
                "input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 3}})
            return r.text

    return run(go()), fake.servers[D2].received


@pytest.mark.parametrize("bound", [1 << 20, "second"])
def test_a_stream_past_the_bound_keeps_nothing_and_is_not_continued(monkeypatch, bound):
    first, both = len(native(" a", [11])), len(native(" a", [11]) + native(" a b", [11, 12]))
    # room for both events (continued), or for the first only (the second drops all)
    monkeypatch.setattr(relay, "CAPTURE_LIMIT", bound if isinstance(bound, int) else both - 1)
    assert first <= both - 1
    body, continued = _broken_stream()
    events = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]
    if bound == "second":
        assert continued == []
        assert "error" in events[-1], body
    else:
        assert [c["input_ids"] for c in continued] == [[1, 2, 3, 11, 12]]
        assert events[-1]["text"] == " a b c", body
