"""The response store shared by processes: two gateway replicas on one real redis-server, a
gateway with `--workers 2` (on Redis, and on its default store), and a store that is down.

A response kept through one process is read, continued and cancelled through another."""

from __future__ import annotations

import contextlib
import threading

import httpx
import openai
import pytest

from tests.integration.conftest import sim_cluster
from tests.procs import HOST, free_port, python, running
from tests.rigs.redis_server import redis_server


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def redis_url(logs):
    with redis_server(logs) as url:
        yield url


@pytest.fixture(scope="module")
def cluster(logs, redis_url):
    with sim_cluster(logs, sim_args=["--token-delay", "0.01"],
                     gateway_args=["--responses-store", redis_url, "--workers", "2"]) as c:
        yield c


@contextlib.contextmanager
def another_gateway(cluster, logs, name: str, *args: str):
    """One more gateway process in front of the cluster's servers; yields its URL."""
    port = free_port()
    argv = python("-m", "gateway", "--host", HOST, "--port", str(port))
    for url, boot in cluster.prefill:
        argv += ["--prefill", url, str(boot)]
    for url in cluster.decode:
        argv += ["--decode", url]
    url = f"http://{HOST}:{port}"
    with running(name, argv + list(args), logs, url + "/readiness"):
        yield url


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def fresh_gets(url: str, rid: str, times: int) -> list[int]:
    """GETs on new connections each (a `--workers` listener spreads connections)."""
    return [httpx.get(f"{url}/v1/responses/{rid}", timeout=10).status_code
            for _ in range(times)]


def test_two_replicas_share_responses(cluster, logs, redis_url):
    with another_gateway(cluster, logs, "replica-b", "--responses-store", redis_url) as b:
        first = sdk(cluster.gateway).responses.create(model="m", input="one",
                                                      max_output_tokens=4)
        assert sdk(b).responses.retrieve(first.id).output_text == first.output_text
        second = sdk(b).responses.create(model="m", input="two", max_output_tokens=4,
                                         previous_response_id=first.id)
        items = httpx.get(f"{cluster.gateway}/v1/responses/{second.id}/input_items",
                          timeout=10).json()["data"]
        assert [i["role"] for i in items] == ["user", "assistant", "user"]
        sdk(b).responses.delete(first.id)
        assert fresh_gets(cluster.gateway, first.id, 4) == [404] * 4


def test_cancel_through_another_replica_aborts_the_running_one(cluster, logs, redis_url):
    with another_gateway(cluster, logs, "replica-c", "--responses-store", redis_url) as other:
        answer: dict = {}
        started = threading.Event()

        def run() -> None:
            with sdk(cluster.gateway).responses.stream(model="m", input="long",
                                                       max_output_tokens=3000) as stream:
                for event in stream:
                    if event.type == "response.created":
                        answer["id"] = event.response.id
                    elif event.type == "response.output_text.delta":
                        started.set()  # the decode generates

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        assert started.wait(20)
        assert sdk(other).responses.cancel(answer["id"]).status == "cancelled"
        worker.join(20)
        assert not worker.is_alive()  # ended long before its 3000 tokens (30 s)
        assert sdk(cluster.gateway).responses.retrieve(answer["id"]).status == "cancelled"


def test_workers_share_the_default_store(cluster, logs):
    with another_gateway(cluster, logs, "workers-default", "--workers", "2") as url:
        kept = sdk(url).responses.create(model="m", input="kept", max_output_tokens=4)
        assert fresh_gets(url, kept.id, 12) == [200] * 12
        follow = [sdk(url).responses.create(model="m", input="more", max_output_tokens=4,
                                            previous_response_id=kept.id).status
                  for _ in range(4)]
        assert all(status in ("completed", "incomplete") for status in follow)


def test_workers_share_redis(cluster):
    kept = sdk(cluster.gateway).responses.create(model="m", input="w", max_output_tokens=4)
    assert fresh_gets(cluster.gateway, kept.id, 12) == [200] * 12


def test_store_down_serves_new_turns_and_refuses_history_with_503(cluster, logs):
    dead = f"redis://{HOST}:{free_port()}/0"  # nothing listens there
    with another_gateway(cluster, logs, "store-down", "--responses-store", dead) as url:
        fresh = sdk(url).responses.create(model="m", input="no history", max_output_tokens=4)
        assert fresh.status in ("completed", "incomplete")
        answer = httpx.post(url + "/v1/responses", timeout=20, json={
            "model": "m", "input": "go on", "previous_response_id": fresh.id})
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert "store" in answer.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/responses/{fresh.id}", timeout=20).status_code == 503
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'gateway_responses_store_errors_total{operation="previous"} 1.0' in metrics
        assert 'gateway_responses_store_errors_total{operation="save"}' in metrics


def test_redis_store_keeps_tenants_apart_and_evicts_the_oldest(redis_url):
    import asyncio  # noqa: PLC0415

    from gateway.responses.redis_store import RedisStore, member  # noqa: PLC0415
    from gateway.responses.store import Retention  # noqa: PLC0415

    async def work():
        store = RedisStore(redis_url, Retention(ttl=60, max_count=3, max_bytes=10_000),
                           prefix="test-evict:")
        await store.start()
        try:
            for i in range(5):
                await store.put("t", f"r{i}", b"x" * 100)
            kept = [i for i in range(5) if await store.get("t", f"r{i}") is not None]
            other = await store.get("u", "r4")
            await store.put("t", "big", b"y" * 9_950)  # over the bytes: older ones go
            after = [i for i in range(5) if await store.get("t", f"r{i}") is not None]
            total = int(await store.client.get("test-evict:total"))
            ttl = await store.client.pttl("test-evict:" + member("t", "big"))
            return kept, other, after, total, ttl
        finally:
            await store.close()

    kept, other, after, total, ttl = asyncio.run(work())
    assert kept == [2, 3, 4] and other is None
    assert after == [] and total == 9_950
    assert 0 < ttl <= 60_000
