"""The shared store's conditional write against a real redis-server: a turn's final save and
a cancel, from two replicas at once, change an in_progress record and exactly one wins (the
status read and the write are one script, so neither overwrites the other)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.responses.redis_store import RedisStore
from gateway.responses.store import Retention
from tests.rigs.redis_server import redis_server

IN_PROGRESS = b'{"status":"in_progress","output":[]}'


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("logs")) as url:
        yield url


async def _stores(url: str, prefix: str, count: int) -> list[RedisStore]:
    stores = [RedisStore(url, Retention(ttl=60), prefix=prefix) for _ in range(count)]
    for store in stores:
        await store.start()
    return stores


@pytest.mark.timeout(60)
def test_two_replicas_swap_an_in_progress_record_and_exactly_one_wins(redis_url):
    done, cancelled = b'{"status":"completed","output":[1]}', b'{"status":"cancelled"}'

    async def work():
        one, two = await _stores(redis_url, "test-swap-race:", 2)
        try:
            outcomes = []
            for i in range(20):
                await one.put("t", f"r{i}", IN_PROGRESS)
                won = await asyncio.gather(one.swap("t", f"r{i}", "in_progress", done),
                                           two.swap("t", f"r{i}", "in_progress", cancelled))
                outcomes.append((won, await two.get("t", f"r{i}")))
            return outcomes, int(await one.client.get("test-swap-race:total"))
        finally:
            await one.close()
            await two.close()

    outcomes, total = asyncio.run(work())
    for won, kept in outcomes:
        assert sorted(won) == [False, True]
        assert kept == (done if won[0] else cancelled)
    assert total == sum(len(kept) for _, kept in outcomes)  # the sizes follow the winner


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stored, written", [
    pytest.param(IN_PROGRESS, True, id="status-as-expected"),
    pytest.param(b'{"status":"completed"}', False, id="finished-first"),
    pytest.param(None, False, id="deleted"),
    pytest.param(b"not json", False, id="not-a-record"),
])
def test_a_swap_writes_only_over_the_expected_status(redis_url, stored, written):
    async def work():
        (store,) = await _stores(redis_url, "test-swap-one:", 1)
        try:
            await store.delete("t", "r")
            if stored is not None:
                await store.put("t", "r", stored)
            won = await store.swap("t", "r", "in_progress", b'{"status":"new"}')
            return won, await store.get("t", "r")
        finally:
            await store.close()

    assert asyncio.run(work()) == (written, b'{"status":"new"}' if written else stored)
