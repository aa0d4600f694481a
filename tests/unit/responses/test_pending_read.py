"""A turn's final save that the store refused, pending behind the answer, and a reader of
that response (GET, the next turn naming it). The reader got the stale in_progress record:
the next turn a non-retryable 400 `previous_response_not_finished` during the outage and up
to 30 s after it (until the save's back-off retry), GET `in_progress` though the client had
the whole stream. Now the reader writes the pending save first (here or in the sibling
worker that holds it) and answers from it, or 503 with Retry-After while the store still
refuses; and a write that succeeds wakes the pending saves' retry."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.errors import ServiceUnavailable
from gateway.responses import service as service_module
from gateway.responses.service import Responses
from tests.responses_turns import begin
from tests.unit.responses.test_pending_saves import (
    BODY,
    PausedStore,
    _finished_while_down,
    _running,
    _status,
)


def _next(rid: str) -> bytes:
    return orjson.dumps({"model": "m", "input": "next", "previous_response_id": rid})


@pytest.mark.timeout(20)
@pytest.mark.parametrize("where", ["same-worker", "sibling-worker"])
def test_the_next_turn_is_503_while_the_store_refuses_then_served_at_once(
        tmp_path, monkeypatch, where):
    monkeypatch.setattr(service_module, "SAVE_AGAIN", (30.0,))  # the retry comes too late

    async def go():
        async with _running(tmp_path) as (serving, other):
            reader = serving if where == "same-worker" else other
            store = serving.store
            turn = await _finished_while_down(serving, store)
            store.down = 2  # the store still refuses writes: the pending save again
            with pytest.raises(ServiceUnavailable) as during:
                await begin(reader, "t", _next(turn.rid))
            with pytest.raises(ServiceUnavailable):
                await reader.read("t", turn.rid, "get")
            following = await begin(reader, "t", _next(turn.rid))  # the store is back
            reader.end(following)
            got = await reader.read("t", turn.rid, "get")
            return during.value.headers, len(following.items), got["status"]

    assert asyncio.run(go()) == ({"retry-after": "2"}, 3, "completed")


@pytest.mark.timeout(20)
def test_a_pending_save_is_not_settled_for_another_tenant(tmp_path, monkeypatch):
    monkeypatch.setattr(service_module, "SAVE_AGAIN", (30.0,))

    async def go():
        async with _running(tmp_path) as (serving, _):
            turn = await _finished_while_down(serving, serving.store)
            return (await serving.read("other", turn.rid, "get"),
                    await _status(serving.store, turn.rid))

    assert asyncio.run(go()) == (None, "in_progress")


@pytest.mark.timeout(20)
def test_a_write_that_succeeds_wakes_the_pending_saves(monkeypatch):
    monkeypatch.setattr(service_module, "SAVE_AGAIN", (30.0,))  # only a wake keeps it soon

    async def go():
        store = PausedStore()
        responses = Responses(store, None, None, None, CollectorRegistry())
        await responses.start()
        try:
            turn = await _finished_while_down(responses, store)
            await asyncio.sleep(0.1)
            another = await begin(responses, "t", BODY)  # its start written: the store is back
            responses.end(another)
            await asyncio.sleep(1.0)
            return await _status(store, turn.rid), dict(responses.pending)
        finally:
            await responses.stop()

    assert asyncio.run(go()) == ("completed", {})
