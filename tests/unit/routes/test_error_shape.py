"""One error shape for every refusal: `{"error": {"message", "type", "param", "code"}}` with
`code` always a string, and no redirect built from the client's Host header."""

import pytest

from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_client as gateway

P, D = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def cluster() -> FakeCluster:
    return FakeCluster({P: FakeServer("prefill"), D: FakeServer("decode")})


CASES = {
    "unknown path": ("GET", "/no/such/path", None, {}, 404),
    "wrong method": ("GET", "/v1/chat/completions", None, {}, 405),
    "wrong method on an admin path": ("PUT", "/admin/servers", None, {}, 405),
    "body not JSON": ("POST", "/v1/chat/completions", b"{not json", {}, 400),
    "body not an object": ("POST", "/v1/chat/completions", b"[1]", {}, 400),
    "bad priority header": ("POST", "/v1/chat/completions", CHAT, {"x-priority": "??"}, 400),
    "trailing slash on chat": ("POST", "/v1/chat/completions/", CHAT, {}, 404),
    "trailing slash on generate": ("POST", "/generate/", {"text": "hi"}, {}, 404),
    "trailing slash on a GET": ("GET", "/v1/models/", None, {}, 404),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_refusal_has_one_shape_and_a_string_code(name):
    method, path, body, headers, status = CASES[name]

    async def go():
        async with gateway(cluster()) as client:
            content = body if isinstance(body, bytes) else None
            return await client.request(method, path, headers={"host": "evil.example",
                                                                  **headers},
                                        json=body if isinstance(body, dict) else None,
                                        content=content)

    r = run(go())
    assert r.status_code == status, (name, r.status_code, r.text)
    assert "location" not in r.headers, r.headers
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["code"], str) and error["code"], error
    assert "evil.example" not in r.text


ADMIN_BODIES = {
    # a plain-text 500 until 2026-12-07: urlsplit's ValueError escaped the URL check
    "brackets around no IPv6 address": ("/admin/servers", {
        "url": "http://[1:2:3:4:5:6:7:8:9:10]:1", "role": "decode"}),
    # logged before it was looked up: its newline forged a log line (2026-12-07)
    "a control character in a switch's URL": ("/admin/servers/role", {
        "url": "http://127.0.0.1:1\n2026-12-07 CRITICAL forged \x1b[31m", "role": "decode"}),
}


@pytest.mark.parametrize("name", list(ADMIN_BODIES))
def test_bad_admin_bodies_are_a_json_400(name):
    path, body = ADMIN_BODIES[name]

    async def go():
        async with gateway(cluster()) as client:
            return await client.post(path, json=body)

    r = run(go())
    assert r.status_code == 400, (name, r.status_code, r.text)
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_deeper_than_orjson_writes_is_relayed_as_sent():
    """`/flush_cache` with a body nested 300 levels (orjson reads 1,024, writes 254): it was
    re-encoded and answered a plain-text 500 (2026-12-07); now relayed as the bytes sent."""
    deep = b'{"x":' + b"[" * 300 + b"1" + b"]" * 300 + b"}"

    async def go():
        async with gateway(cluster()) as client:
            return await client.post("/flush_cache", content=deep,
                                     headers={"content-type": "application/json"})

    r = run(go())
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True


def test_a_bug_on_a_route_is_a_json_500():
    """An exception no handler expected, on a Starlette route: the usual error shape, no
    text of the exception (it was `text/plain` "Internal Server Error")."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from gateway.routes.errors import HANDLERS

    async def broken(request):
        raise RuntimeError("secret detail of a bug")

    app = Starlette(routes=[Route("/admin/x", broken)], exception_handlers=HANDLERS)
    r = TestClient(app, raise_server_exceptions=False).get("/admin/x")
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "internal_error"
    assert "secret" not in r.text
