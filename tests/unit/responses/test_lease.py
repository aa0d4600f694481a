"""A running turn's lease: the process serving a turn renews it; when that process stops
(killed, out of memory) its in_progress record is read as failed by every reader, instead of
in_progress for its whole retention (GET, a next turn and a cancel, in another process)."""

from __future__ import annotations

import asyncio
import sqlite3

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.errors import BadRequest
from gateway.responses.service import Responses
from gateway.responses.store import Retention, SQLiteStore
from tests.responses_turns import begin

RENEW, LEASE = 0.05, 0.5  # seconds: a loaded machine may delay a renewal or two
BODY = b'{"model": "m", "input": "hi"}'


def _shared_file(tmp_path):
    path = str(tmp_path / "responses.sqlite3")
    return (SQLiteStore(path, Retention(), lease=LEASE),
            SQLiteStore(path, Retention(), lease=LEASE))


def _one_memory_store(tmp_path):
    store = SQLiteStore(None, Retention(), lease=LEASE)
    return store, store


async def _started(store) -> Responses:
    responses = Responses(store, None, None, None, CollectorRegistry(), renew_every=RENEW)
    await responses.start()
    return responses


def _killed(responses: Responses) -> None:
    """The process is gone: its renewals stop, and nothing of its turn ends (no finally)."""
    responses._renewer.cancel()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stores", [
    pytest.param(_shared_file, id="sqlite-file-two-processes"),
    pytest.param(_one_memory_store, id="memory"),
])
def test_a_turn_whose_process_stopped_reads_as_failed_to_get_a_chain_and_a_cancel(
        tmp_path, stores):
    async def go():
        serving, other = [await _started(s) for s in stores(tmp_path)]
        try:
            turn = await begin(serving, "t", BODY)
            await asyncio.sleep(3 * LEASE)  # renewed all along: still running
            running = (await other.read("t", turn.rid, "get"))["status"]
            _killed(serving)
            await asyncio.sleep(2 * LEASE)
            got = await other.read("t", turn.rid, "get")
            with pytest.raises(BadRequest) as chained:
                await begin(other, "t", orjson.dumps(
                    {"model": "m", "input": "next", "previous_response_id": turn.rid}))
            cancelled = await other.cancel("t", turn.rid)
            return running, got, chained.value, cancelled
        finally:
            await serving.stop()
            if other.store is serving.store:  # closed once
                _killed(other)
            else:
                await other.stop()

    running, got, chained, cancelled = asyncio.run(go())
    assert running == "in_progress"
    assert got["status"] == got["response"]["status"] == "failed"
    assert got["response"]["error"]["code"] == "server_error"
    assert "stopped" in got["response"]["error"]["message"]
    assert chained.code == "previous_response_not_finished"
    assert "is failed (the gateway process serving this response stopped" in chained.message
    assert cancelled["status"] == "failed"  # not "cancelled": nothing runs to cancel


@pytest.mark.timeout(20)
def test_a_finished_turn_ends_its_lease_and_reads_as_it_finished(tmp_path):
    async def go():
        one, two = _shared_file(tmp_path)
        serving, other = await _started(one), await _started(two)
        try:
            turn = await begin(serving, "t", BODY)
            held = await two.leased("t", turn.rid)
            serving.end(turn)
            await serving.keep(turn, {"id": turn.rid, "status": "completed", "output": []})
            await asyncio.sleep(2 * LEASE)
            return held, await two.leased("t", turn.rid), await other.read("t", turn.rid, "get")
        finally:
            await serving.stop()
            await other.stop()

    held, after, record = asyncio.run(go())
    assert (held, after, record["status"]) == (True, False, "completed")


class CountingStore(SQLiteStore):
    """Memory, with every renewal noted."""

    def __init__(self) -> None:
        super().__init__(None, Retention(), lease=LEASE)
        self.renewals: list[list] = []

    async def renew(self, keys: list[tuple[str, str]]) -> None:
        self.renewals.append(sorted(keys))
        await super().renew(keys)


@pytest.mark.timeout(20)
def test_the_running_turns_are_renewed_together_once_per_period():
    async def go():
        store = CountingStore()
        responses = await _started(store)
        try:
            turns = [await begin(responses, "t", BODY) for _ in range(3)]
            unkept = await begin(responses, "t", b'{"model": "m", "input": "x", "store": false}')
            store.renewals.clear()  # those before every turn had begun
            await asyncio.sleep(10 * RENEW)
            return store.renewals, sorted(("t", t.rid) for t in turns), unkept.rid
        finally:
            await responses.stop()

    renewals, kept, unkept = asyncio.run(go())
    assert 3 <= len(renewals) <= 11
    assert all(keys == kept for keys in renewals)  # one write for all, not the unkept one
    assert unkept not in str(renewals)


@pytest.mark.timeout(20)
def test_a_database_of_the_version_without_leases_opens_and_its_running_rows_read_failed(
        tmp_path):
    path = str(tmp_path / "old.sqlite3")
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE responses (
            tenant TEXT NOT NULL, id TEXT NOT NULL, written REAL NOT NULL,
            size INTEGER NOT NULL, record BLOB NOT NULL, PRIMARY KEY (tenant, id));
        CREATE INDEX responses_written ON responses (written);""")
    for rid, status in (("resp_a", "in_progress"), ("resp_b", "completed")):
        record = orjson.dumps({"status": status, "input": [], "output": [],
                               "response": {"id": rid, "status": status}})
        old.execute("INSERT INTO responses VALUES ('t', ?, ?, ?, ?)",
                    (rid, 4e9, len(record), record))
    old.commit()
    old.close()

    async def go():
        responses = await _started(SQLiteStore(path, Retention(ttl=1e10), lease=LEASE))
        try:
            turn = await begin(responses, "t", BODY)  # the new column is written
            return ((await responses.read("t", "resp_a", "get"))["status"],
                    (await responses.read("t", "resp_b", "get"))["status"],
                    (await responses.read("t", turn.rid, "get"))["status"])
        finally:
            await responses.stop()

    assert asyncio.run(go()) == ("failed", "completed", "in_progress")
