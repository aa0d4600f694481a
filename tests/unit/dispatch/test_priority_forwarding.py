"""Priority classes through the whole request path, on the scripted in-memory cluster: what
each leg carries as SGLang's `priority`, the 400s for bad headers, session routing."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.unit.fakes import FakeCluster, FakeServer
from tests.unit.fakes import served_client as gateway

P1, P2 = "http://127.0.0.1:30000", "http://127.0.0.1:30002"
D1 = "http://127.0.0.1:30001"
BODY = {"text": "hello", "priority": 999}  # a client's own priority


def send(cluster, extra, headers, body=BODY, times=1) -> list[httpx.Response]:
    async def go():
        async with gateway(cluster, *extra) as client:
            return [await client.post("/generate", json=body, headers=headers)
                    for _ in range(times)]

    return asyncio.run(asyncio.wait_for(go(), 20))


def cluster(prefill_info: dict, decode_info: dict) -> FakeCluster:
    return FakeCluster({P1: FakeServer("prefill", info=prefill_info),
                        D1: FakeServer("decode", info=decode_info)})


SCHEDULING = {"enable_priority_scheduling": True}


@pytest.mark.parametrize("mode, prefill_info, decode_info, expected", [
    ("auto", SCHEDULING, {}, (20, None)),
    ("auto", {}, {}, (None, None)),
    ("auto", SCHEDULING, {**SCHEDULING, "schedule_low_priority_values_first": True},
     (20, -20)),
    ("on", {}, {}, (20, 20)),
    ("off", SCHEDULING, SCHEDULING, (999, 999)),
], ids=["auto-prefill-only", "auto-neither", "auto-low-first-decode", "on", "off"])
def test_each_leg_carries_the_priority_its_server_schedules_by(mode, prefill_info,
                                                               decode_info, expected):
    c = cluster(prefill_info, decode_info)
    [r] = send(c, ["--forward-priority", mode], {"x-priority": "interactive"})
    assert r.status_code == 200, r.text
    got = tuple(c.servers[u].received[0].get("priority") for u in (P1, D1))
    assert got == expected


def test_the_tenants_cap_holds_on_the_server_too():
    c = cluster(SCHEDULING, SCHEDULING)
    extra = ["--api-keys", "k1", "--tenants", '{"*": {"max_priority": "batch", '
             '"priority": "batch"}}']
    [r] = send(c, extra, {"x-priority": "interactive", "authorization": "Bearer k1"})
    assert r.status_code == 200
    assert [c.servers[u].received[0]["priority"] for u in (P1, D1)] == [0, 0]


@pytest.mark.parametrize("headers, fragment", [
    ({"x-priority": "urgent"}, "unknown priority class"),
    ({"x-request-timeout": "-1"}, "x-request-timeout"),
    ({"x-session-id": "a b"}, "x-session-id"),
], ids=["priority", "deadline", "session"])
def test_bad_headers_get_a_400_in_the_openai_shape_and_reach_no_server(headers, fragment):
    c = cluster({}, {})
    [r] = send(c, ["--session-header", "x-session-id"], headers)
    assert r.status_code == 400
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_header" and error["request_id"]
    assert not c.servers[P1].received and not c.servers[D1].received


def test_a_session_sticks_to_one_prefill_while_round_robin_alternates():
    c = FakeCluster({P1: FakeServer("prefill"), P2: FakeServer("prefill"),
                     D1: FakeServer("decode")})
    extra = ["--session-header", "x-session-id"]
    responses = send(c, extra, {"x-session-id": "conv-7"}, {"text": "hi"}, times=6)
    assert all(r.status_code == 200 for r in responses)
    counts = sorted(len(c.servers[u].received) for u in (P1, P2))
    assert counts == [0, 6]
    before = {u: len(c.servers[u].received) for u in (P1, P2)}
    send(c, extra, {}, {"text": "hi"}, times=4)  # no session: the policy's round robin
    assert all(len(c.servers[u].received) - before[u] == 2 for u in (P1, P2))
