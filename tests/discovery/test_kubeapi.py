"""The pods API client against httpx.MockTransport: paging, auth, statuses, watch lines."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from gateway.discovery.kubeapi import ApiError, Gone, KubeAPI

SERVER = "https://k8s.test:6443"


def lines(*events: dict) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


def api_with(handler, **kwargs) -> KubeAPI:
    return KubeAPI(SERVER, transport=httpx.MockTransport(handler), **kwargs)


async def collect(api: KubeAPI, version: str = "5") -> list[dict]:
    stream = api.watch_pods("ns", "app=x", version, 30)
    async with contextlib.aclosing(stream):
        return [event async for event in stream]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_list_follows_continue_tokens():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.url.params))
        if "continue" not in request.url.params:
            return httpx.Response(200, json={"metadata": {"continue": "c1", "resourceVersion": "7"},
                                             "items": [{"metadata": {"name": "a"}}]})
        return httpx.Response(200, json={"metadata": {"resourceVersion": "7"},
                                         "items": [{"metadata": {"name": "b"}}]})

    pods, version = run(api_with(handler).list_pods("ns", "app=x,role=prefill"))
    assert [p["metadata"]["name"] for p in pods] == ["a", "b"] and version == "7"
    assert seen[0] == {"labelSelector": "app=x,role=prefill", "limit": "500"}
    assert seen[1]["continue"] == "c1"


def test_token_file_is_read_for_every_request(tmp_path):
    token = tmp_path / "token"
    auth = []

    def handler(request: httpx.Request) -> httpx.Response:
        auth.append(request.headers.get("authorization"))
        assert request.url.path == "/api/v1/namespaces/ns/pods"
        return httpx.Response(200, json={"metadata": {"resourceVersion": "1"}, "items": []})

    api = api_with(handler, token_file=str(token))

    async def go():
        token.write_text("first\n")
        await api.list_pods("ns", "")
        token.write_text("rotated")
        await api.list_pods("ns", "")

    run(go())
    assert auth == ["Bearer first", "Bearer rotated"]


@pytest.mark.parametrize("status, error", [(410, Gone), (403, ApiError), (500, ApiError)],
                         ids=["gone", "forbidden", "server-error"])
def test_list_errors(status, error):
    def handler(request):
        return httpx.Response(status, json={"kind": "Status", "code": status,
                                            "message": "pods is forbidden"})

    with pytest.raises(error) as info:
        run(api_with(handler).list_pods("ns", ""))
    assert info.value.status == status and "pods is forbidden" in str(info.value)


def test_unreachable_is_an_api_error():
    def handler(request):
        raise httpx.ConnectError("refused")

    with pytest.raises(ApiError) as info:
        run(api_with(handler).list_pods("ns", ""))
    assert info.value.status is None and not isinstance(info.value, Gone)


def test_missing_token_file_is_an_api_error(tmp_path):
    api = api_with(lambda r: httpx.Response(200), token_file=str(tmp_path / "none"))
    with pytest.raises(ApiError, match="cannot read the API token"):
        run(api.list_pods("ns", ""))


def test_watch_parameters_and_events():
    params = {}
    pod = {"metadata": {"name": "a", "resourceVersion": "6"}}
    bookmark = {"metadata": {"resourceVersion": "9"}}

    def handler(request):
        params.update(request.url.params)
        body = lines({"type": "ADDED", "object": pod}, {"type": "BOOKMARK", "object": bookmark})
        return httpx.Response(200, content=body + b"\n")  # a blank line is skipped

    events = run(collect(api_with(handler)))
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    assert params == {"labelSelector": "app=x", "watch": "1", "resourceVersion": "5",
                      "allowWatchBookmarks": "true", "timeoutSeconds": "30"}


@pytest.mark.parametrize("body, status, error", [
    (lines({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}),
     200, Gone),
    (lines({"type": "ERROR", "object": {"kind": "Status", "code": 500}}), 200, ApiError),
    (b'{"type": "ADDED", "obj', 200, ApiError),
    (json.dumps({"kind": "Status", "code": 410}).encode(), 410, Gone),
    (b"overloaded", 503, ApiError),
], ids=["error-event-410", "error-event-500", "torn-line", "http-410", "http-503"])
def test_watch_errors(body, status, error):
    with pytest.raises(error) as info:
        run(collect(api_with(lambda r: httpx.Response(status, content=body))))
    assert type(info.value) is error
