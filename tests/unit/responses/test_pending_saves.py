"""A turn's final save that the store refused, pending behind the answer: a cancel that comes
once the store is back must not win over a response its client got whole (here, or in the
sibling worker that holds the save), and a turn whose refused start was written all the same
has its final save tried again too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.errors import ServiceUnavailable
from gateway.processes.siblings import Siblings
from gateway.responses import service as service_module
from gateway.responses.service import Responses
from gateway.responses.store import Retention, SQLiteStore, StoreDown
from tests.responses_turns import begin

BODY = b'{"model": "m", "input": "hi"}'


class PausedStore(SQLiteStore):
    """A file (memory without `path`) whose next `down` writes through this store are
    refused, `applied` of them after being written (a Redis reply that timed out after the
    command ran)."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__(path, Retention())
        self.down = 0
        self.applied = 0

    async def _refused(self, write):
        if not self.down:
            return await write
        self.down -= 1
        if self.applied:
            self.applied -= 1
            await write
        else:
            write.close()
        raise StoreDown("the store is paused")

    async def put(self, tenant: str, rid: str, record: bytes, leased: bool = False) -> None:
        await self._refused(super().put(tenant, rid, record, leased))

    async def swap(self, tenant: str, rid: str, expected: str, record: bytes) -> bool:
        return await self._refused(super().swap(tenant, rid, expected, record))


class Control:
    """The control channel of `--workers`, as two workers see it: a question is answered by
    the other worker's handler."""

    def __init__(self) -> None:
        self.handlers: dict = {}
        self.peer: Control | None = None

    def on(self, kind: str, handler) -> None:
        self.handlers[kind] = handler

    async def ask(self, msg: dict) -> list:
        return [await self.peer.handlers[msg["kind"]](msg)]


def _workers(tmp_path) -> tuple[Responses, Responses]:
    """Two workers, each with its own connection to one store file."""
    one, two = Control(), Control()
    one.peer, two.peer = two, one
    path = str(tmp_path / "responses.sqlite3")
    return tuple(Responses(PausedStore(path), None, None,
                           Siblings(c, None, None, None, None, None), CollectorRegistry())
                 for c in (one, two))


@contextlib.asynccontextmanager
async def _running(tmp_path) -> AsyncIterator[tuple[Responses, Responses]]:
    """The two workers of `_workers`, started, and stopped at the end."""
    serving, other = _workers(tmp_path)
    for worker in (serving, other):
        await worker.start()
    try:
        yield serving, other
    finally:
        await serving.stop()
        await other.stop()


async def _status(store, rid: str) -> str:
    return orjson.loads(await store.get("t", rid))["status"]


async def _finished_while_down(serving: Responses, store: PausedStore):
    """A turn whose final save (completed, sent whole to its client) the store refused."""
    turn = await begin(serving, "t", BODY)
    store.down = 1
    await serving.keep(turn, {"id": turn.rid, "status": "completed", "output": ["x"]})
    serving.end(turn)
    return turn


@pytest.mark.timeout(20)
@pytest.mark.parametrize("where", ["same-worker", "sibling-worker"])
def test_a_cancel_after_the_store_is_back_finds_the_pending_save_and_loses(
        tmp_path, monkeypatch, where):
    monkeypatch.setattr(service_module, "SAVE_AGAIN", (30.0,))  # the retry comes too late

    async def go():
        async with _running(tmp_path) as (serving, other):
            store = serving.store
            turn = await _finished_while_down(serving, store)
            pending = await _status(store, turn.rid)
            answered = await (serving if where == "same-worker" else other).cancel(
                "t", turn.rid)
            return pending, answered["status"], await _status(store, turn.rid)

    assert asyncio.run(go()) == ("in_progress", "completed", "completed")


@pytest.mark.timeout(20)
def test_a_cancel_whose_sibling_cannot_write_the_pending_save_is_503_not_won(
        tmp_path, monkeypatch):
    monkeypatch.setattr(service_module, "SAVE_AGAIN", (30.0,))

    async def go():
        async with _running(tmp_path) as (serving, other):
            store = serving.store
            turn = await _finished_while_down(serving, store)
            store.down = 1  # the serving worker's write of it is refused again
            with pytest.raises(ServiceUnavailable):
                await other.cancel("t", turn.rid)
            return await _status(store, turn.rid)

    assert asyncio.run(go()) == "in_progress"


@pytest.mark.timeout(20)
def test_a_start_written_though_refused_gets_its_final_save_tried_again(monkeypatch):
    monkeypatch.setattr(service_module, "SAVE_AGAIN", (0.01, 0.01, 0.01))

    async def go():
        store = PausedStore()
        responses = Responses(store, None, None, None, CollectorRegistry())
        await responses.start()
        try:
            store.down, store.applied = 2, 1  # the start written, its answer lost; the
            turn = await begin(responses, "t", BODY)  # final save refused once
            started = await _status(store, turn.rid)
            await responses.keep(turn, {"id": turn.rid, "status": "completed", "output": []})
            responses.end(turn)
            await asyncio.sleep(0.3)
            return turn.kept, started, await _status(store, turn.rid)
        finally:
            await responses.stop()

    assert asyncio.run(go()) == (True, "in_progress", "completed")
