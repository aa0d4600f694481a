"""The Responses service's writes: a final save the store refused is tried again."""

from __future__ import annotations

import asyncio

import orjson
from prometheus_client import CollectorRegistry

from gateway.responses import service as service_module
from gateway.responses.service import Responses
from gateway.responses.store import Retention, SQLiteStore, StoreDown
from tests.responses_turns import begin


class FlakyStore(SQLiteStore):
    """An in-memory store whose next `down` writes fail (a store paused or locked)."""

    def __init__(self) -> None:
        super().__init__(None, Retention())
        self.down = 0

    def _refuse(self) -> None:
        if self.down:
            self.down -= 1
            raise StoreDown("the store is paused")

    async def put(self, tenant: str, rid: str, record: bytes, leased: bool = False) -> None:
        self._refuse()
        await super().put(tenant, rid, record, leased)

    async def swap(self, tenant: str, rid: str, expected: str, record: bytes) -> bool:
        self._refuse()
        return await super().swap(tenant, rid, expected, record)


def status_of(store: FlakyStore, rid: str):
    async def read():
        raw = await store.get("t", rid)
        return orjson.loads(raw)["status"] if raw is not None else None
    return read()


def test_a_final_save_the_store_refused_is_kept_once_it_recovers(monkeypatch):
    """The client got its whole answer; the store refused the final save (paused, locked):
    the record must not stay in_progress for good, or no next turn may follow it."""
    monkeypatch.setattr(service_module, "SAVE_AGAIN", (0.01, 0.01, 0.01, 0.01))

    async def go():
        store = FlakyStore()
        responses = Responses(store, None, None, None, CollectorRegistry())
        await responses.start()
        turn = await begin(responses, "t", b'{"model": "m", "input": "hi"}')
        assert await status_of(store, turn.rid) == "in_progress"
        store.down = 2  # the final save and its first retry fail
        await responses.keep(turn, {"id": turn.rid, "status": "completed", "output": []})
        assert await status_of(store, turn.rid) == "in_progress"
        await asyncio.sleep(0.2)
        assert await status_of(store, turn.rid) == "completed"
        await responses.stop()

    asyncio.run(go())


def test_a_store_that_never_recovers_gives_up_without_hanging_the_stop(monkeypatch):
    monkeypatch.setattr(service_module, "SAVE_AGAIN", (0.01, 30.0))

    async def go():
        store = FlakyStore()
        responses = Responses(store, None, None, None, CollectorRegistry())
        await responses.start()
        turn = await begin(responses, "t", b'{"model": "m", "input": "hi"}')
        store.down = 10
        await responses.keep(turn, {"id": turn.rid, "status": "completed", "output": []})
        await asyncio.sleep(0.05)
        async with asyncio.timeout(2):  # the retry waiting 30 s is cancelled
            await responses.stop()

    asyncio.run(go())
