"""A gateway whose SQLite response store is locked by another writer (a backup holding
`BEGIN EXCLUSIVE`): turns asked at once are served within the store's deadline, their
records refused and counted, and the store works again once the lock goes
(docs/RESPONSES.md, "When the store is down").

Until 2026-12-07 (no deadline; found by a repro): 10 turns during a 45 s lock each took 45 s,
and a cancel during a 12 s lock 9.7-9.8 s.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.conftest import sim_cluster
from tests.unit.responses.test_store_locked import locked

TURNS = 6
BOUND = 4.0  # seconds a turn may take: the 2 s deadline, the answer, a slow runner


@pytest.fixture(scope="module")
def store_file(tmp_path_factory):
    return str(tmp_path_factory.mktemp("store") / "responses.sqlite3")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, store_file):
    with sim_cluster(tmp_path_factory.mktemp("logs"), n_decode=1,
                     sim_args=["--token-delay", "0.01"],
                     gateway_args=["--responses-store", store_file]) as c:
        yield c


async def _timed(client: httpx.AsyncClient, method: str, path: str,
                 body: dict | None = None) -> tuple[int, float]:
    began = time.monotonic()
    answer = await client.request(method, path, json=body)
    await answer.aread()
    return answer.status_code, time.monotonic() - began


async def _during_the_lock(url: str) -> list[tuple[int, float]]:
    """TURNS turns (every other one streamed) and a cancel, all at once."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        works = [_timed(client, "POST", "/v1/responses", {
            "model": "m", "input": f"turn {i}", "max_output_tokens": 8, "stream": i % 2 == 1})
            for i in range(TURNS)]
        works.append(_timed(client, "POST", "/v1/responses/resp_none/cancel"))
        return await asyncio.gather(*works)


def _errors(url: str, operation: str) -> float:
    name = f'gateway_responses_store_errors_total{{operation="{operation}"}} '
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line[len(name):])
    return 0.0


def test_turns_during_a_locked_store_are_served_within_its_deadline(cluster, store_file):
    url = cluster.gateway
    warm = httpx.post(url + "/v1/responses", timeout=30,
                      json={"model": "m", "input": "warm", "max_output_tokens": 4})
    assert warm.status_code == 200
    with locked(store_file):
        answered = asyncio.run(_during_the_lock(url))
    turns, (cancel, cancel_took) = answered[:TURNS], answered[TURNS]
    assert [status for status, _ in turns] == [200] * TURNS
    assert max(took for _, took in turns) < BOUND, turns
    assert cancel in (404, 503) and cancel_took < BOUND
    assert _errors(url, "start") == TURNS
    after = httpx.post(url + "/v1/responses", timeout=30,
                       json={"model": "m", "input": "after", "max_output_tokens": 4})
    kept = httpx.get(f"{url}/v1/responses/{after.json()['id']}", timeout=10)
    assert kept.status_code == 200 and kept.json()["status"] in ("completed", "incomplete")
