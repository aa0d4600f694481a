"""The /dashboard page and its JSON, on a scripted in-memory cluster (no sockets)."""

from __future__ import annotations

import asyncio
import re
from collections import deque

import pytest

from gateway.routes.dashboard import ERROR_FIELDS, RECENT_ERRORS_SHOWN
from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_gateway as gateway

P1 = "http://127.0.0.1:30000"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"


def three_servers() -> FakeCluster:
    return FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode"),
                        D2: FakeServer("decode")})


def test_page_is_self_contained_html():
    async def go():
        async with gateway(three_servers()) as (client, _):
            return await client.get("/dashboard")

    r = run(go())
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    page = r.text
    assert 'id="servers"' in page and 'id="last-update"' in page
    # Offline machine, no build step: nothing may be loaded from elsewhere.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page and "url(http" not in page


def test_data_describes_servers_roles_requests_and_cache():
    async def go():
        async with gateway(three_servers()) as (client, _):
            for _ in range(3):
                assert (await client.post("/generate", json={"text": "hi"})).status_code == 200
            assert (await client.post("/generate", content=b"{bad")).status_code == 400
            for _ in range(100):  # a prefill leg may finish just after its answer was sent
                r = await client.get("/dashboard/data")
                if r.json()["cache"]["prompt_tokens"] == 12:
                    break
                await asyncio.sleep(0.01)
            return r

    r = run(go())
    assert r.status_code == 200
    data = r.json()
    assert data["roles"] == {"prefill": {"total": 1, "usable": 1},
                             "decode": {"total": 2, "usable": 2}}
    by_url = {s["url"]: s for s in data["servers"]}
    assert set(by_url) == {P1, D1, D2}
    assert by_url[P1]["role"] == "prefill" and by_url[P1]["breaker"] == "closed"
    for server in data["servers"]:
        assert {"healthy", "draining", "in_flight", "in_flight_tokens", "load"} <= set(server)
    assert by_url[P1]["prompt_tokens"] == 12 and by_url[P1]["cached_tokens"] == 6
    assert data["requests"]["total"] == 4
    assert data["requests"]["by_status"] == {"200": 3, "400": 1}
    assert data["requests"]["errors"] == 0 and data["requests"]["client_errors"] == 1
    assert data["cache"] == {"prompt_tokens": 12, "cached_tokens": 6, "hit_ratio": 0.5}
    assert data["admission"]["active"] == 0
    assert data["gateway"]["ready"] is True
    errors = data["recent_errors"]  # empty until the gateway keeps its errors
    assert errors == [] or (errors[0]["status"], errors[0]["endpoint"]) == (400, "generate")
    assert data["time"] > 0


def test_no_traffic_gives_no_hit_ratio():
    async def go():
        async with gateway(three_servers()) as (client, _):
            return (await client.get("/dashboard/data")).json()

    data = run(go())
    assert data["cache"]["hit_ratio"] is None
    assert data["requests"] == {"total": 0, "in_flight": 0, "received": 0, "errors": 0,
                                "client_errors": 0, "by_status": {}}


def test_recent_errors_newest_first_and_bounded():
    """Reads the gateway state's ring buffer of errors (a deque of dicts, or plain text)."""
    many = RECENT_ERRORS_SHOWN + 5

    async def go():
        async with gateway(three_servers()) as (client, gw):
            gw.state.recent_errors = deque(maxlen=100)
            for i in range(many):
                gw.state.recent_errors.append({"time": 1000.0 + i, "endpoint": "generate",
                                               "status": 502, "type": "upstream_error",
                                               "message": f"error {i}", "request_id": f"r{i}",
                                               "extra": object()})
            gw.state.recent_errors.append("a plain text entry")
            return (await client.get("/dashboard/data")).json()

    errors = run(go())["recent_errors"]
    assert len(errors) == RECENT_ERRORS_SHOWN
    assert errors[0] == {**dict.fromkeys(ERROR_FIELDS), "message": "a plain text entry"}
    assert errors[1]["message"] == f"error {many - 1}" and errors[1]["status"] == 502
    assert set(errors[1]) == set(ERROR_FIELDS)


@pytest.mark.parametrize("headers, status", [
    ({}, 401),
    ({"authorization": "Bearer wrong"}, 401),
    ({"authorization": "Bearer admin-key"}, 200),
    ({"x-api-key": "admin-key"}, 200),
], ids=["no-key", "wrong-key", "bearer", "x-api-key"])
def test_data_needs_the_admin_key_when_one_is_set(headers, status):
    async def go():
        async with gateway(three_servers(), "--admin-api-keys", "admin-key") as (client, _):
            page = await client.get("/dashboard")
            return page.status_code, (await client.get("/dashboard/data", headers=headers))

    page_status, r = run(go())
    assert page_status == 200  # the page itself holds no data
    assert r.status_code == status
