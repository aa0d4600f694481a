"""Two-leg dispatch semantics, on a scripted in-memory cluster (no sockets)."""

import asyncio
import time

import orjson
import pytest

from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served as gateway

P1, P2 = "http://127.0.0.1:30000", "http://127.0.0.1:30002"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"


def test_both_legs_get_same_body_with_bootstrap_fields():
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})

    async def go():
        async with gateway(cluster) as (client, _):
            r = await client.post("/generate", json={"text": "hello"})
            assert r.status_code == 200
            assert r.json()["text"] == "decode:hello"

    run(go())
    p, d = cluster.servers[P1].received[0], cluster.servers[D1].received[0]
    assert p == d
    assert p["bootstrap_host"] == "127.0.0.1" and p["bootstrap_port"] == 8998
    assert isinstance(p["bootstrap_room"], int) and 0 <= p["bootstrap_room"] < 2**63


def test_batch_gets_one_room_per_item():
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})

    async def go():
        async with gateway(cluster) as (client, _):
            await client.post("/generate", json={"text": ["a", "b", "c"]})

    run(go())
    body = cluster.servers[D1].received[0]
    assert len(set(body["bootstrap_room"])) == 3
    assert body["bootstrap_host"] == ["127.0.0.1"] * 3
    assert body["bootstrap_port"] == [8998] * 3


def test_prefill_failure_cancels_hanging_decode_fast():
    cluster = FakeCluster({P1: FakeServer("prefill", status=500),
                           D1: FakeServer("decode", hang=True)})

    async def go():
        async with gateway(cluster, "--max-attempts", "1") as (client, _):
            t0 = time.perf_counter()
            r = await client.post("/generate", json={"text": "x"})
            elapsed = time.perf_counter() - t0
            await asyncio.sleep(0.05)
            return r, elapsed

    r, elapsed = run(go())
    assert r.status_code == 502
    err = r.json()["error"]
    assert "prefill server" in err["message"] and "500" in err["message"]
    assert elapsed < 1.0
    assert cluster.servers[D1].cancelled == 1
    assert cluster.servers[D1].aborts, "decode was not asked to abort by rid"


def test_decode_failure_cancels_hanging_prefill():
    cluster = FakeCluster({P1: FakeServer("prefill", hang=True),
                           D1: FakeServer("decode", status=503, delay=0.05)})

    async def go():
        async with gateway(cluster, "--max-attempts", "1") as (client, _):
            r = await client.post("/generate", json={"text": "x"})
            await asyncio.sleep(0.05)
            return r

    r = run(go())
    assert r.status_code == 502
    assert "decode server" in r.json()["error"]["message"]
    assert cluster.servers[P1].cancelled == 1


def test_retry_uses_other_pair_and_new_rooms():
    cluster = FakeCluster({P1: FakeServer("prefill", status=500), P2: FakeServer("prefill"),
                           D1: FakeServer("decode", delay=0.05), D2: FakeServer("decode", delay=0.05)})

    async def go():
        async with gateway(cluster) as (client, app):
            r = await client.post("/generate", json={"text": "x"})
            metrics = (await client.get("/metrics")).text
            return r, metrics

    r, metrics = run(go())
    assert r.status_code == 200
    rooms = [b["bootstrap_room"] for s in cluster.servers.values() for b in s.received]
    assert len(cluster.servers[P2].received) == 1
    assert len(set(rooms)) == 2  # one room per attempt, both legs of an attempt share it
    assert 'gateway_retries_total{leg="prefill",reason="500"} 1.0' in metrics


def test_client_error_is_not_retried_and_keeps_status():
    cluster = FakeCluster({P1: FakeServer("prefill"), P2: FakeServer("prefill"),
                           D1: FakeServer("decode", status=400), D2: FakeServer("decode")})

    async def go():
        async with gateway(cluster) as (client, _):
            return await client.post("/generate", json={"text": "x"})

    r = run(go())
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert len(cluster.servers[D1].received) + len(cluster.servers[D2].received) == 1


def test_logprob_merge_non_stream():
    def prefill_body(body):
        return {"text": "", "meta_info": {"input_token_logprobs": [[-1.0, 7, None], [-2.0, 8, None]]}}

    def decode_body(body):
        return {"text": "out", "meta_info": {"input_token_logprobs": [[-3.0, 9, None]],
                                             "output_token_logprobs": [[-0.5, 10, None]]}}

    cluster = FakeCluster({P1: FakeServer("prefill", body=prefill_body),
                           D1: FakeServer("decode", body=decode_body)})

    async def go():
        async with gateway(cluster) as (client, _):
            return await client.post("/generate", json={"text": "x", "return_logprob": True})

    meta = run(go()).json()["meta_info"]
    assert [t[1] for t in meta["input_token_logprobs"]] == [7, 8, 9]
    assert meta["output_token_logprobs"] == [[-0.5, 10, None]]


def test_stream_relays_bytes_unchanged():
    chunks = [b'data: {"text":"a"}\n\n', b'data: {"te', b'xt":"ab"}\n\n', b"data: [DONE]\n\n"]
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", chunks=chunks)})

    async def go():
        async with gateway(cluster) as (client, _):
            async with client.stream("POST", "/generate", json={"text": "x", "stream": True}) as r:
                return r.status_code, r.headers["content-type"], b"".join(
                    [c async for c in r.aiter_raw()])

    status, ctype, body = run(go())
    assert status == 200 and ctype.startswith("text/event-stream")
    assert body == b"".join(chunks)


def test_stream_failing_midway_ends_with_error_event_and_done():
    chunks = [b'data: {"text":"a"}\n\n', b'data: {"text":"a', b"<error>"]
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", chunks=chunks)})

    async def go():
        async with gateway(cluster) as (client, _):
            r = await client.post("/generate", json={"text": "x", "stream": True})
            return r.content

    body = run(go())
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = orjson.loads(events[-2][len(b"data: "):])
    assert "decode server" in error["error"]["message"]


def test_stream_failing_before_first_chunk_is_retried():
    good = [b'data: {"text":"ok"}\n\n', b"data: [DONE]\n\n"]
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=[b"<error>"]),
                           D2: FakeServer("decode", chunks=good)})

    async def go():
        async with gateway(cluster) as (client, _):
            r = await client.post("/generate", json={"text": "x", "stream": True})
            return r.status_code, r.content

    status, body = run(go())
    assert status == 200 and body == b"".join(good)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_no_usable_pair_is_503(path):
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})

    async def go():
        async with gateway(cluster) as (client, app):
            for w in app.state.gateway.pool:
                if w.role == "decode":
                    w.draining = True
            return await client.post(path, json={"text": "x", "prompt": "x",
                                                 "messages": [{"role": "user", "content": "x"}]})

    r = run(go())
    assert r.status_code == 503
    assert "no usable decode server" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
    assert cluster.servers[P1].received == []  # never one leg alone


def test_counters_return_to_zero():
    cluster = FakeCluster({P1: FakeServer("prefill", status=500), D1: FakeServer("decode", hang=True)})

    async def go():
        async with gateway(cluster) as (client, app):
            await asyncio.gather(*(client.post("/generate", json={"text": "x"}) for _ in range(5)))
            await asyncio.sleep(0.05)
            return [(w.in_flight, w.in_flight_tokens) for w in app.state.gateway.pool]

    assert run(go()) == [(0, 0), (0, 0)]


@pytest.mark.parametrize(
    "first_event",
    [
        b'data: {"text":"","meta_info":{"finish_reason":{"type":"abort","message":"Decode '
        b'transfer failed","status_code":500}}}\n\n',
        b'data: {"error":{"object":"error","message":"KV transfer failed","type":'
        b'"InternalServerError","param":null,"code":500}}\n\n',
    ],
    ids=["native-abort-500", "openai-error-500"],
)
def test_stream_whose_first_event_is_a_server_failure_is_retried(first_event):
    good = [b'data: {"text":"ok"}\n\n', b"data: [DONE]\n\n"]
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=[first_event, b"data: [DONE]\n\n"]),
                           D2: FakeServer("decode", chunks=good)})

    async def go():
        async with gateway(cluster) as (client, _):
            r = await client.post("/generate", json={"text": "x", "stream": True})
            return r.status_code, r.content

    status, body = run(go())
    assert status == 200 and body == b"".join(good)


def test_stream_graceful_abort_is_relayed_not_retried():
    abort = (b'data: {"text":"","meta_info":{"finish_reason":{"type":"abort",'
             b'"message":"Abort"}}}\n\n')
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=[abort, b"data: [DONE]\n\n"]),
                           D2: FakeServer("decode", chunks=[b"data: [DONE]\n\n"])})

    async def go():
        async with gateway(cluster) as (client, _):
            r = await client.post("/generate", json={"text": "x", "stream": True})
            return r.content

    assert run(go()) == abort + b"data: [DONE]\n\n"


def test_stream_client_error_event_becomes_4xx():
    bad = b'data: {"error":{"message":"max_tokens too large","code":400}}\n\n'
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", chunks=[bad, b"data: [DONE]\n\n"])})

    async def go():
        async with gateway(cluster) as (client, _):
            return await client.post("/v1/completions", json={"prompt": "x", "stream": True})

    r = run(go())
    assert r.status_code == 400
    assert "max_tokens too large" in r.json()["error"]["message"]


def test_stream_that_stalls_ends_with_a_timeout_event():
    chunks = [b'data: {"text":"a"}\n\n', b"<hang>"]
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", chunks=chunks)})

    async def go():
        async with gateway(cluster, "--stream-idle-timeout", "0.3") as (client, _):
            t0 = time.perf_counter()
            r = await client.post("/generate", json={"text": "x", "stream": True})
            return r.content, time.perf_counter() - t0

    body, elapsed = run(go())
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = orjson.loads(events[-2][len(b"data: "):])["error"]
    assert "went silent mid-stream" in error["message"] and error["code"] == "504"
    assert 0.25 < elapsed < 5


def test_the_request_deadline_caps_its_attempts_and_names_itself():
    """--request-timeout below the learned/cold first-progress deadline: the attempt ends at
    the request's deadline with a 504 that says so, and no server is blamed for it."""
    cluster = FakeCluster({P1: FakeServer("prefill", hang=True),
                           D1: FakeServer("decode", hang=True)})

    async def go():
        async with gateway(cluster, "--request-timeout", "0.3") as (client, app):
            started = time.monotonic()
            r = await client.post("/generate", json={"text": "x"})
            took = time.monotonic() - started
            server = next(w for w in app.state.gateway.pool if w.url == P1)
            return r, took, server

    r, took, prefill = run(go())
    assert r.status_code == 504
    assert "request did not complete within 0.3s" in r.json()["error"]["message"]
    assert 0.25 < took < 3.0
    assert prefill.breaker.consecutive_failures == 0 and prefill.suspect_until == 0.0
