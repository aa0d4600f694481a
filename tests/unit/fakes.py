"""A scripted in-memory PD cluster behind httpx.MockTransport for socket-free unit tests.

Each server URL maps to a behaviour: answer, fail with a status, hang until cancelled, or
stream chunks. The fake records what it received and which requests were cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from gateway.app import build_app
from gateway.config.settings import load_config


@dataclass
class FakeServer:
    role: str
    status: int = 200
    hang: bool = False
    delay: float = 0.0
    # streaming body chunks, or a function of the request's body giving them
    chunks: list[bytes] | Callable[[dict], list[bytes]] | None = None
    body: Callable[[dict], dict] | None = None
    received: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # loop time of each request
    cancelled: int = 0
    aborts: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # more /server_info fields (dp_size, ...)
    fail_if: Callable[[dict], bool] | None = None  # answer 500 to the bodies it selects
    hang_if: Callable[[dict], bool] | None = None  # never answer the bodies it selects
    tokenized: int = 0  # /v1/tokenize calls
    headers: list[dict] = field(default_factory=list)  # request headers, with `received`
    whole: list[bytes] | None = None  # a non-streamed 200 answer's raw body, in these chunks


class FakeCluster:
    def __init__(self, servers: dict[str, FakeServer]) -> None:
        self.servers = servers

    async def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        server = self.servers[base]
        path = request.url.path
        if path == "/server_info":
            return httpx.Response(200, json={"disaggregation_mode": server.role,
                                             "disaggregation_bootstrap_port": 8998,
                                             "served_model_name": "fake", **server.info})
        if path in ("/health", "/v1/loads"):
            return httpx.Response(200, json={"loads": []})
        if path == "/v1/tokenize":  # one token per 2 characters of the prompt
            asked = json.loads(request.content)
            prompt = asked.get("prompt")
            if isinstance(prompt, list):
                return httpx.Response(200, json={"count": [len(p) // 2 for p in prompt]})
            server.tokenized += 1
            text = prompt if prompt is not None else json.dumps(asked.get("messages"))
            return httpx.Response(200, json={"count": len(text) // 2})
        if path == "/abort_request":
            server.aborts.append(json.loads(request.content)["rid"])
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        server.received.append(body)
        server.headers.append(dict(request.headers))
        server.arrivals.append(asyncio.get_running_loop().time())
        try:
            if server.hang or (server.hang_if is not None and server.hang_if(body)):
                await asyncio.Event().wait()
            if server.delay:
                await asyncio.sleep(server.delay)
        except asyncio.CancelledError:
            server.cancelled += 1
            raise
        if server.fail_if is not None and server.fail_if(body):
            return httpx.Response(500, json={"error": {"message": f"{server.role} pair broken"}})
        if server.status >= 400:
            return httpx.Response(server.status, json={"error": {"message": f"{server.role} boom"}})
        if server.chunks is not None and body.get("stream"):
            chunks = server.chunks(body) if callable(server.chunks) else server.chunks
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_ChunkStream(chunks))
        if server.whole is not None and not body.get("stream"):
            return httpx.Response(200, headers={"content-type": "application/json"},
                                  stream=_ChunkStream(server.whole))
        payload = server.body(body) if server.body else {
            "text": f"{server.role}:{body.get('text')}",
            "meta_info": {"prompt_tokens": 4, "cached_tokens": 2},
        }
        return httpx.Response(200, json=payload)


class _ChunkStream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            if chunk == b"<hang>":
                await asyncio.Event().wait()
            if chunk == b"<error>":
                raise httpx.ReadError("connection reset")
            if chunk == b"<pause>":  # what came before arrives as a read of its own
                await asyncio.sleep(0.05)
                continue
            yield chunk


def make_app(cluster: FakeCluster, *extra: str):
    prefill = [u for u, s in cluster.servers.items() if s.role == "prefill"]
    decode = [u for u, s in cluster.servers.items() if s.role == "decode"]
    argv = ["--prefill", ",".join(prefill), "--decode", ",".join(decode),
            "--policy", "round_robin", "--loads-interval", "0", "--retry-backoff", "0.001",
            *extra]
    return build_app(load_config(argv, environ={}), transport=httpx.MockTransport(cluster.handle))


@contextlib.asynccontextmanager
async def served(cluster: FakeCluster, *extra: str):
    """The gateway app for `cluster`, its lifespan running, and an in-process client to it."""
    app = make_app(cluster, *extra)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client, app


@contextlib.asynccontextmanager
async def served_client(cluster: FakeCluster, *extra: str):
    async with served(cluster, *extra) as (client, _):
        yield client


@contextlib.asynccontextmanager
async def served_gateway(cluster: FakeCluster, *extra: str):
    """The client and the app's `runtime.Gateway`."""
    async with served(cluster, *extra) as (client, app):
        yield client, app.state.gateway


def run(coro, timeout: float = 20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# A conversation's turns for the trailing-prefill tests (tests/unit/dispatch/test_*trailing*):
# ten random words a message, a fixed chat answer, and how late the prefill answers.
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
TRAIL = 0.3  # seconds the prefill's answer comes after the decode's


def words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(10))


def chat_answer(body: dict) -> dict:
    return {"id": "c", "object": "chat.completion", "model": "fake",
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "echo golf hotel kilo"}}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48}}


async def chat_turns(client, rng: random.Random, turns: int, after_each) -> None:
    """One conversation's `turns` chat turns back to back through the gateway's `client`,
    each the whole history so far; `after_each(turn)` runs as each answer has come."""
    messages = [{"role": "system", "content": words(rng)}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}: {words(rng)}"})
        answer = await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": messages, "max_tokens": 8})
        assert answer.status_code == 200, answer.text
        messages.append(answer.json()["choices"][0]["message"])
        after_each(turn)
