"""A finished response must not be lost because its running record went away. A store byte
limit filled by other tenants evicted a long turn's in_progress record (oldest first), and
its final save, taking the missing record for a delete, wrote nothing: the client had the
whole answer, GET and the next turn naming it got 404. Now a running turn's record is not
evicted, a record lost all the same (here: past its TTL) is written again by the final save,
and a delete while the turn runs leaves a tombstone, so that response stays deleted. Against
the SQLite store and a real redis-server (docs/RESPONSES.md, "The store")."""

from __future__ import annotations

import asyncio
import itertools

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.errors import NotFound
from gateway.responses.redis_store import RedisStore
from gateway.responses.service import Responses, Turn
from gateway.responses.store import Retention, SQLiteStore
from tests.responses_turns import begin
from tests.rigs.redis_server import redis_server

BODY = b'{"model": "m", "input": "a long turn"}'
BIG = orjson.dumps({"model": "m", "input": "word " * 1500})  # a record of about 7.5 KB
PREFIXES = itertools.count()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("logs")) as url:
        yield url


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path):
    """A store of the given retention: a SQLite file, or keys of their own on the redis."""
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None

    def make(retention: Retention):
        if url is None:
            return SQLiteStore(str(tmp_path / f"r{next(PREFIXES)}.sqlite3"), retention)
        return RedisStore(url, retention, prefix=f"test-lost-{next(PREFIXES)}:")
    return make


async def _serving(store) -> Responses:
    responses = Responses(store, None, None, None, CollectorRegistry())
    await responses.start()
    return responses


def _final(turn: Turn) -> dict:
    return {"id": turn.rid, "object": "response", "status": "completed",
            "output": [{"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "whole"}]}]}


async def _served(responses: Responses, tenant: str, body: bytes) -> Turn:
    """A turn begun, finished and kept."""
    turn = await begin(responses, tenant, body)
    await responses.keep(turn, _final(turn))
    responses.end(turn)
    return turn


def _next(rid: str) -> bytes:
    return orjson.dumps({"model": "m", "input": "next", "previous_response_id": rid})


@pytest.mark.timeout(20)
def test_other_tenants_writes_past_the_byte_limit_do_not_lose_a_running_turn(make_store):
    async def go():
        responses = await _serving(make_store(Retention(max_bytes=60_000)))
        try:
            long = await begin(responses, "alice", BODY)
            bobs = [await _served(responses, "bob", BIG) for _ in range(12)]
            await responses.keep(long, _final(long))
            responses.end(long)
            got = await responses.read("alice", long.rid, "get")
            following = await begin(responses, "alice", _next(long.rid))
            responses.end(following)
            first_bob = await responses.read("bob", bobs[0].rid, "get")
            return got and got["status"], len(following.items), first_bob
        finally:
            await responses.stop()

    # the whole history continued (its input, its output, the new input); the limit was
    # kept by evicting the oldest finished records
    assert asyncio.run(go()) == ("completed", 3, None)


@pytest.mark.timeout(20)
def test_when_only_running_turns_are_left_the_limit_is_passed_until_they_finish(make_store):
    async def go():
        responses = await _serving(make_store(Retention(max_bytes=10)))
        try:
            one, two = [await begin(responses, "t", BODY) for _ in range(2)]
            running = [(await responses.read("t", t.rid, "get") or {}).get("status")
                       for t in (one, two)]
            for turn in (one, two):
                await responses.keep(turn, _final(turn))
                responses.end(turn)
            ended = [(await responses.read("t", t.rid, "get") or {}).get("status")
                     for t in (one, two)]
            return running, ended
        finally:
            await responses.stop()

    assert asyncio.run(go()) == (["in_progress", "in_progress"], [None, "completed"])


@pytest.mark.timeout(20)
def test_a_final_save_that_finds_its_record_gone_writes_it_again(make_store):
    async def go():
        responses = await _serving(make_store(Retention(ttl=1.0)))
        try:
            turn = await begin(responses, "t", BODY)
            await asyncio.sleep(1.3)  # its running record is past its TTL: gone
            gone = await responses.store.get("t", turn.rid)
            kept = await responses.keep(turn, _final(turn))
            responses.end(turn)
            got = await responses.read("t", turn.rid, "get")
            return gone, kept, got and got["status"]
        finally:
            await responses.stop()

    assert asyncio.run(go()) == (None, "completed", "completed")


@pytest.mark.timeout(20)
def test_a_response_deleted_while_it_runs_stays_deleted_past_evictions(make_store):
    async def go():
        responses = await _serving(make_store(Retention(max_bytes=60_000)))
        store = responses.store
        try:
            turn = await begin(responses, "alice", BODY)
            deleted = await store.delete("alice", turn.rid), await store.delete("alice", turn.rid)
            for _ in range(12):  # its tombstone is kept while the turn runs
                await _served(responses, "bob", BIG)
            read = await responses.read("alice", turn.rid, "get")
            kept = await responses.keep(turn, _final(turn))
            responses.end(turn)
            with pytest.raises(NotFound):
                await begin(responses, "alice", _next(turn.rid))
            return deleted, read, kept, await store.get("alice", turn.rid)
        finally:
            await responses.stop()

    # the second delete is 404; nothing of it is left once its turn ended (the tombstone too)
    assert asyncio.run(go()) == ((True, False), None, None, None)
