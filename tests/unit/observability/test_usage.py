"""Usage per tenant and model, on a scripted in-memory cluster (no sockets)."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from gateway.runtime import StartupError
from gateway.sse import DONE, frame
from tests.unit.fakes import FakeCluster, FakeServer, run
from tests.unit.fakes import served_gateway as gateway

P1 = "http://127.0.0.1:30000"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"
KEYS = {"acme": "key-acme", "beta": "key-beta"}


def decode_answer(body: dict) -> dict:
    return {"text": "out", "meta_info": {"prompt_tokens": 4, "cached_tokens": 2,
                                         "completion_tokens": 7}}


def key_file(tmp_path) -> list[str]:
    path = tmp_path / "keys"
    path.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    return ["--api-key-file", str(path)]


def as_key(tenant: str) -> dict:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


async def settled(client, gw) -> dict:
    """/admin/usage once every prefill leg has ended (a prefill may answer after the
    decode)."""
    for _ in range(200):
        if all(not w.totals()[0] for w in gw.pool):
            break
        await asyncio.sleep(0.01)
    return (await client.get("/admin/usage")).json()


def test_usage_is_counted_per_tenant_and_model(tmp_path):
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode",
                                                                     body=decode_answer)})

    async def go():
        async with gateway(cluster, *key_file(tmp_path)) as (client, gw):
            for tenant, count in (("acme", 2), ("beta", 1)):
                for _ in range(count):
                    r = await client.post("/generate", json={"text": "hi"},
                                          headers=as_key(tenant))
                    assert r.status_code == 200
            assert (await client.post("/generate", content=b"{bad",
                                      headers=as_key("beta"))).status_code == 400
            assert (await client.post("/generate", json={"text": "hi"})).status_code == 401
            report = await settled(client, gw)
            metrics = (await client.get("/metrics")).text
            return report, metrics

    report, metrics = run(go())
    acme = report["tenants"]["acme"]["models"]["fake"]
    assert acme == {"requests": 2, "errors_4xx": 0, "errors_5xx": 0, "prompt_tokens": 8,
                    "cached_tokens": 4, "uncached_tokens": 4, "completion_tokens": 14}
    beta = report["tenants"]["beta"]["total"]
    assert (beta["requests"], beta["errors_4xx"], beta["completion_tokens"]) == (2, 1, 7)
    assert report["tenants"]["anonymous"]["total"]["errors_4xx"] == 1  # no key: 401
    assert report["total"]["requests"] == 5 and report["total"]["prompt_tokens"] == 12
    assert 'gateway_tenant_tokens_total{kind="cached",model="fake",tenant="acme"} 4.0' in metrics


def test_the_tenants_prompt_tokens_add_up_to_the_servers_over_retries(tmp_path):
    """A retry ran a second prefill: both count, for the tenant as for the server."""
    # the first decode fails only after its prefill answered: two prefills ran
    cluster = FakeCluster({P1: FakeServer("prefill"),
                           D1: FakeServer("decode", status=500, delay=0.05),
                           D2: FakeServer("decode", body=decode_answer)})
    log = tmp_path / "access.log"

    async def go():
        async with gateway(cluster, *key_file(tmp_path), "--access-log", str(log)) \
                as (client, gw):
            r = await client.post("/generate", json={"text": "hi"}, headers=as_key("acme"))
            assert r.status_code == 200
            report = await settled(client, gw)
            metrics = (await client.get("/metrics")).text
            return report, metrics

    report, metrics = run(go())
    assert report["tenants"]["acme"]["total"]["prompt_tokens"] == 8
    assert f'gateway_prompt_tokens_total{{server="{P1}"}} 8.0' in metrics
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert (line["attempts"], line["retries"], line["decode"], line["status"]) == \
        (2, 1, D2, 200)
    assert KEYS["acme"] not in log.read_text() and '"hi"' not in log.read_text()


def test_a_prefill_answering_after_the_decode_is_still_in_the_line(tmp_path):
    cluster = FakeCluster({P1: FakeServer("prefill", delay=0.3),
                           D1: FakeServer("decode", body=decode_answer)})
    log = tmp_path / "access.log"

    async def go():
        async with gateway(cluster, "--access-log", str(log)) as (client, gw):
            r = await client.post("/generate", json={"text": "hi"})
            assert r.status_code == 200
            early = gw.usage.report(gw.read_metrics())["total"]
            return early, await settled(client, gw)

    early, report = run(go())
    assert (early["requests"], early["prompt_tokens"]) == (1, 0)  # answered before prefill
    assert report["total"]["prompt_tokens"] == 4
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert (line["prompt_tokens"], line["cached_tokens"], line["completion_tokens"]) == (4, 2, 7)
    assert line["ttft_s"] < line["duration_s"] < 0.3  # the client had its answer early


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "q"}], "stream": True}
CONTENT = {"id": "c", "object": "chat.completion.chunk",
           "choices": [{"index": 0, "delta": {"content": "hey"}, "finish_reason": "stop"}]}
USAGE = {"id": "c", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}}


@pytest.mark.parametrize("asked", [False, True], ids=["client-did-not-ask", "client-asked"])
def test_an_openai_streams_usage_event_is_read_and_shown_only_if_asked(asked):
    decode = FakeServer("decode", chunks=[frame(CONTENT), frame(USAGE) + DONE])
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: decode})
    body = {**CHAT, "stream_options": {"include_usage": True}} if asked else CHAT

    async def go():
        async with gateway(cluster) as (client, gw):
            r = await client.post("/v1/chat/completions", json=body)
            return r.content, await settled(client, gw)

    content, report = run(go())
    assert decode.received[0]["stream_options"] == {"include_usage": True}
    assert cluster.servers[P1].received[0]["stream_options"] == {"include_usage": True}
    expected = frame(CONTENT) + (frame(USAGE) if asked else b"") + DONE
    assert content == expected
    assert report["total"]["completion_tokens"] == 5


def test_an_unwritable_access_log_stops_the_start(tmp_path):
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})

    async def go():
        async with gateway(cluster, "--access-log", str(tmp_path / "no" / "such.log")):
            pass

    with pytest.raises(StartupError, match="access log"):
        run(go())


def test_a_native_answers_completion_count_is_the_sum_of_its_items():
    def batch(body: dict) -> list:
        return [{"text": "a", "meta_info": {"completion_tokens": n}} for n in (2, 3)]

    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", body=batch)})

    async def go():
        async with gateway(cluster) as (client, gw):
            r = await client.post("/generate", json={"text": ["a", "b"]})
            assert orjson.loads(r.content)[1]["meta_info"]["completion_tokens"] == 3
            return await settled(client, gw)

    assert run(go())["total"]["completion_tokens"] == 5


def test_a_request_refused_by_its_keys_rate_limit_counts_as_the_keys_tenant(tmp_path):
    """The 429 of a key's own request bucket is raised while the key is checked, before the
    request knew its tenant: it was counted (access log, /admin/usage, tenant metrics) as
    `anonymous`."""
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode",
                                                                     body=decode_answer)})
    log = tmp_path / "access.log"

    async def go():
        async with gateway(cluster, *key_file(tmp_path), "--rate-limit", "0.001",
                           "--rate-burst", "1", "--access-log", str(log)) as (client, gw):
            statuses = [(await client.post("/generate", json={"text": "hi"},
                                           headers=as_key("acme"))).status_code
                        for _ in range(3)]
            report = await settled(client, gw)
            return statuses, report, (await client.get("/metrics")).text

    statuses, report, metrics = run(go())
    assert statuses == [200, 429, 429]
    acme = report["tenants"]["acme"]["total"]
    assert (acme["requests"], acme["errors_4xx"]) == (3, 2), report
    assert "anonymous" not in report["tenants"], report
    tenant_lines = [x for x in metrics.splitlines() if x.startswith("gateway_tenant_")]
    assert not [x for x in tenant_lines if 'tenant="anonymous"' in x], tenant_lines
    assert sum(float(x.rsplit(" ", 1)[1]) for x in tenant_lines if x.startswith(
        "gateway_tenant_errors_total") and 'tenant="acme"' in x) == 2.0, tenant_lines
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert sorted((x["tenant"], x["status"]) for x in lines) == \
        [("acme", 200), ("acme", 429), ("acme", 429)]  # a line is written when usage settles


def chat_event(finish: object = None, **delta) -> bytes:
    return frame({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "fake",
                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


ROLE = chat_event(role="assistant", content="")
REFUSED = frame({"error": {"message": "refused mid-stream", "code": 400}})  # no continuation


@pytest.mark.parametrize("flags, counted", [((), 4), (("--no-midstream-failover",), 2)],
                         ids=["kept-for-a-continuation", "chunks-only"])
def test_a_stream_cut_before_its_usage_event_counts_what_it_relayed(flags, counted):
    """The decode relayed 4 events with text (in 3 reads) and then failed: the client got
    them, but without the usage event the stream counted 0 completion tokens. Now a stream
    kept for a continuation counts its events with text (4: more events than chunks, so
    they are scanned); one not kept, one per chunk relayed but the role event's (2: a lower
    bound, never more than the tokens)."""
    decode = FakeServer("decode", chunks=[
        ROLE + chat_event(content="a") + chat_event(content="b"), b"<pause>",
        chat_event(content="c"), b"<pause>", chat_event(content="d"), b"<pause>", REFUSED])
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: decode})

    async def go():
        async with gateway(cluster, *flags) as (client, gw):
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert b"refused mid-stream" in r.content and len(decode.received) == 1
            return await settled(client, gw)

    assert run(go())["total"]["completion_tokens"] == counted


def test_a_whole_stream_counts_its_usage_event_and_not_its_events_too():
    decode = FakeServer("decode", chunks=[
        ROLE + chat_event(content="a"), b"<pause>", chat_event(content="b"), b"<pause>",
        chat_event(finish="length"), b"<pause>", frame(USAGE) + DONE])
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: decode})

    async def go():
        async with gateway(cluster) as (client, gw):
            await client.post("/v1/chat/completions", json=CHAT)
            return await settled(client, gw)

    assert run(go())["total"]["completion_tokens"] == 5  # the usage event's, exactly


def test_a_whole_stream_whose_server_sent_no_usage_event_counts_none_as_before():
    """A lone decode stream that ended by itself passed on its usage event if its server
    sends one; without one (not SGLang, which always sends it when asked) nothing was cut,
    and the stream counts no completion tokens, as it did."""
    decode = FakeServer("decode", chunks=[ROLE, b"<pause>", chat_event(content="a"), DONE])
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: decode})

    async def go():
        async with gateway(cluster) as (client, gw):
            assert (await client.post("/v1/chat/completions", json=CHAT)).content.endswith(DONE)
            return await settled(client, gw)

    assert run(go())["total"]["completion_tokens"] == 0
