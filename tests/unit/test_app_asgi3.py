"""The gateway's ASGI app is an ASGI 3 app to the servers that detect it (uvicorn, Starlette's
test client), though its `__call__` hands back the endpoint's coroutine instead of awaiting it
(one coroutine frame less per streamed event)."""

from __future__ import annotations

import asyncio

import httpx
import uvicorn

from gateway.app import build_app
from gateway.config.settings import load_config

SERVERS = ["--prefill", "http://127.0.0.1:1", "9", "--decode", "http://127.0.0.1:2",
           "--skip-probe", "--health-interval", "600", "--loads-interval", "0"]


def test_uvicorn_detects_asgi3() -> None:
    app = build_app(load_config(SERVERS))
    config = uvicorn.Config(app, interface="auto")
    config.load()
    assert config.interface == "asgi3"
    assert asyncio.iscoroutinefunction(app.__call__)  # what Starlette's test client asks


def test_a_call_answers_through_the_returned_coroutine() -> None:
    app = build_app(load_config(SERVERS))

    async def main() -> httpx.Response:
        async with app.app.router.lifespan_context(app.app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                return await client.post("/generate", content=b"not json")

    answer = asyncio.run(main())
    assert answer.status_code == 400
    assert answer.json()["error"]["type"]
