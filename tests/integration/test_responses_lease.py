"""A running turn's lease on the shared store, against a real redis-server: two replicas (or
`--workers`) on one Redis; the one serving a turn stops without ending it (SIGKILL), and the
other reads the record as failed once the lease lapsed: GET, a next turn and a cancel. The
lease's expiry is Redis's own, so whichever replica reads agrees."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.errors import BadRequest
from gateway.responses.redis_store import RedisStore
from gateway.responses.service import Responses
from gateway.responses.store import Retention
from tests.responses_turns import begin
from tests.rigs.redis_server import redis_server

RENEW, LEASE = 0.1, 1.0  # seconds
BODY = b'{"model": "m", "input": "hi"}'


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("logs")) as url:
        yield url


async def _replica(url: str, prefix: str) -> Responses:
    store = RedisStore(url, Retention(ttl=60), prefix=prefix, lease=LEASE)
    responses = Responses(store, None, None, None, CollectorRegistry(), renew_every=RENEW)
    await responses.start()
    return responses


@pytest.mark.timeout(60)
def test_a_replica_that_stopped_mid_turn_leaves_a_record_every_replica_reads_failed(redis_url):
    async def go():
        serving = await _replica(redis_url, "test-lease-stop:")
        other = await _replica(redis_url, "test-lease-stop:")
        try:
            turn = await begin(serving, "t", BODY)
            await asyncio.sleep(3 * LEASE)  # renewed all along
            running = (await other.read("t", turn.rid, "get"))["status"]
            serving._renewer.cancel()  # killed: no renewal, nothing of the turn ends
            await asyncio.sleep(2 * LEASE)
            got = await other.read("t", turn.rid, "get")
            with pytest.raises(BadRequest) as chained:
                await begin(other, "t", orjson.dumps(
                    {"model": "m", "input": "next", "previous_response_id": turn.rid}))
            return running, got, chained.value, await other.cancel("t", turn.rid)
        finally:
            await serving.stop()
            await other.stop()

    running, got, chained, cancelled = asyncio.run(go())
    assert running == "in_progress"
    assert got["status"] == got["response"]["status"] == "failed"
    assert got["response"]["error"]["code"] == "server_error"
    assert chained.code == "previous_response_not_finished" and "failed" in chained.message
    assert cancelled["status"] == "failed"


@pytest.mark.timeout(60)
def test_the_final_save_and_a_delete_end_the_lease_in_the_same_write(redis_url):
    async def go():
        serving = await _replica(redis_url, "test-lease-end:")
        store = serving.store
        try:
            saved = await begin(serving, "t", BODY)
            deleted = await begin(serving, "t", BODY)
            held = [await store.leased("t", t.rid) for t in (saved, deleted)]
            serving.end(saved)  # renewed no more (a renewal racing the final save would
            serving.end(deleted)  # leave a lease on a finished record, unread, 1 s)
            await serving.keep(saved, {"id": saved.rid, "status": "completed", "output": []})
            await store.delete("t", deleted.rid)
            await store.renew([("t", deleted.rid)])  # a renewal late for a deleted record
            ended = [await store.leased("t", t.rid) for t in (saved, deleted)]
            return held, ended, await store.client.keys("test-lease-end:lease:*")
        finally:
            await serving.stop()

    held, ended, lease_keys = asyncio.run(go())
    assert held == [True, True]
    assert ended == [False, False]
    assert lease_keys == []
