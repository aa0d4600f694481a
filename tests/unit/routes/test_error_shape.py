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
