"""The embedded response store: per-tenant records, the three retention limits, a file two
processes share, and StoreDown when it cannot answer."""

from __future__ import annotations

import asyncio

import pytest

from gateway.responses import store as store_module
from gateway.responses.store import Retention, SQLiteStore, StoreDown


def run(coro):
    return asyncio.run(coro)


async def _with(store: SQLiteStore, work):
    await store.start()
    try:
        return await work(store)
    finally:
        await store.close()


def test_records_are_per_tenant():
    async def work(s):
        await s.put("a", "resp_1", b'{"x":1}')
        return (await s.get("a", "resp_1"), await s.get("b", "resp_1"),
                await s.delete("b", "resp_1"), await s.delete("a", "resp_1"),
                await s.get("a", "resp_1"))

    assert run(_with(SQLiteStore(None, Retention()), work)) == (
        b'{"x":1}', None, False, True, None)


@pytest.mark.parametrize("retention, sizes, kept", [
    pytest.param(Retention(max_count=3), [10] * 5, ["r2", "r3", "r4"], id="count"),
    pytest.param(Retention(max_bytes=2500), [1000] * 4, ["r2", "r3"], id="bytes"),
    pytest.param(Retention(max_count=10, max_bytes=10_000), [100] * 4,
                 ["r0", "r1", "r2", "r3"], id="within-limits"),
    # one record over the byte bound alone: it is kept, the older ones go (before: it went
    # with them, so its client's next turn found nothing)
    pytest.param(Retention(max_bytes=2500), [100, 100, 3000], ["r2"], id="one-over-the-bound"),
])
def test_the_oldest_go_first(retention, sizes, kept, monkeypatch):
    clock = iter(range(1000, 2000))
    monkeypatch.setattr(store_module.time, "time", lambda: float(next(clock)))

    async def work(s):
        for i, size in enumerate(sizes):
            await s.put("t", f"r{i}", b"x" * size)
        return [f"r{i}" for i in range(len(sizes)) if await s.get("t", f"r{i}") is not None]

    assert run(_with(SQLiteStore(None, retention), work)) == kept


def test_a_record_past_its_ttl_is_gone(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(store_module.time, "time", lambda: now[0])

    async def work(s):
        await s.put("t", "old", b"1")
        now[0] += 59
        alive = await s.get("t", "old")
        now[0] += 2
        return alive, await s.get("t", "old")

    assert run(_with(SQLiteStore(None, Retention(ttl=60)), work)) == (b"1", None)


def test_a_file_is_shared_by_two_stores(tmp_path):
    path = str(tmp_path / "responses.sqlite3")

    async def work():
        one, two = SQLiteStore(path, Retention()), SQLiteStore(path, Retention())
        await one.start()
        await two.start()
        try:
            await one.put("t", "resp_9", b"kept")
            return await two.get("t", "resp_9")
        finally:
            await one.close()
            await two.close()

    assert run(work()) == b"kept"


def test_an_unusable_path_is_store_down(tmp_path):
    store = SQLiteStore(str(tmp_path / "missing-dir" / "x.sqlite3"), Retention())
    with pytest.raises(StoreDown) as down:
        run(store.start())
    assert down.value.status == 503 and down.value.headers["retry-after"]


IN_PROGRESS = b'{"status":"in_progress","output":[]}'


def test_two_writers_swap_an_in_progress_record_and_exactly_one_wins(tmp_path):
    """A turn's final save and a cancel, each through its own connection to one file (two
    `--workers`): both ask for the in_progress record; one gets it, the other is told so."""
    path = str(tmp_path / "responses.sqlite3")
    done, cancelled = b'{"status":"completed","output":[1]}', b'{"status":"cancelled"}'

    async def work():
        one, two = SQLiteStore(path, Retention()), SQLiteStore(path, Retention())
        await one.start()
        await two.start()
        try:
            outcomes = []
            for i in range(20):
                await one.put("t", f"r{i}", IN_PROGRESS)
                won = await asyncio.gather(one.swap("t", f"r{i}", "in_progress", done),
                                           two.swap("t", f"r{i}", "in_progress", cancelled))
                outcomes.append((won, await two.get("t", f"r{i}")))
            return outcomes
        finally:
            await one.close()
            await two.close()

    for won, kept in run(work()):
        assert sorted(won) == [False, True]
        assert kept == (done if won[0] else cancelled)


@pytest.mark.parametrize("stored, expected, written", [
    pytest.param(IN_PROGRESS, "in_progress", True, id="status-as-expected"),
    pytest.param(b'{"status":"completed"}', "in_progress", False, id="finished-first"),
    pytest.param(None, "in_progress", False, id="deleted"),
    pytest.param(b"not json", "in_progress", False, id="not-a-record"),
])
def test_a_swap_writes_only_over_the_expected_status(stored, expected, written):
    async def work(s):
        if stored is not None:
            await s.put("t", "r", stored)
        return await s.swap("t", "r", expected, b'{"status":"new"}'), await s.get("t", "r")

    assert run(_with(SQLiteStore(None, Retention()), work)) == (
        written, b'{"status":"new"}' if written else stored)
