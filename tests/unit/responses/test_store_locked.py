"""A SQLite store whose file another writer holds locked (a backup's `BEGIN EXCLUSIVE`):
every operation answers within the store's deadline, however many are asked at once, and
a turn is served, its store errors counted (docs/RESPONSES.md, "When the store is down").

Before the deadline each queued write waited its own 5 s busy timeout after those ahead of
it: 8 turns asked at once during a lock took 5, 10, ... 40 s, or the whole lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.responses.service import Responses
from gateway.responses.store import Retention, SQLiteStore, StoreDown
from tests.responses_turns import begin

AT_ONCE = 8
BOUND = 3.0  # seconds each operation may take: the 2 s deadline, and room for a slow runner
LOCK_HELD = 30.0  # the lock outlives every bound; the test ends it when done


@contextlib.contextmanager
def locked(path: str):
    """Another connection holding the file's write lock until the block ends."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")
        held.set()
        release.wait(LOCK_HELD)
        db.execute("ROLLBACK")
        db.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(5), "the lock was not taken"
    try:
        yield
    finally:
        release.set()
        thread.join(5)


async def timed(work) -> tuple[object, float]:
    """What `work` returned or raised, and the seconds it took."""
    began = time.monotonic()
    try:
        outcome = await work
    except StoreDown as exc:
        outcome = exc
    return outcome, time.monotonic() - began


async def all_within(works) -> list[tuple[object, float]]:
    """Every work at once; the test fails at BOUND (plus a margin) rather than waiting out
    the lock."""
    async with asyncio.timeout(BOUND + 1.0):
        return await asyncio.gather(*(timed(work) for work in works))


def test_writes_asked_at_once_each_fail_within_the_deadline_and_none_runs_late(tmp_path):
    path = str(tmp_path / "responses.sqlite3")

    async def go() -> None:
        store = SQLiteStore(path, Retention())
        await store.start()
        try:
            with locked(path):
                outcomes = await all_within(
                    [store.put("t", f"r{i}", b"{}") for i in range(AT_ONCE)]
                    + [store.swap("t", "r0", "in_progress", b"{}"), store.delete("t", "r0")])
            for outcome, took in outcomes:
                assert isinstance(outcome, StoreDown) and took < BOUND
            # refused, and not written once the lock went either: missed, not run late
            assert [await store.get("t", f"r{i}") for i in range(AT_ONCE)] == [None] * AT_ONCE
        finally:
            await store.close()

    asyncio.run(go())


def test_a_read_queued_behind_a_blocked_write_is_answered_within_the_deadline(tmp_path):
    path = str(tmp_path / "responses.sqlite3")

    async def go() -> None:
        store = SQLiteStore(path, Retention())
        await store.start()
        await store.put("t", "kept", b"{}")
        try:
            with locked(path):
                (_, _), (read, took) = await all_within(
                    [store.put("t", "new", b"{}"), store.get("t", "kept")])
            # a WAL reader is not blocked by the lock: answered if its turn came in time
            assert read == b"{}" or isinstance(read, StoreDown)
            assert took < BOUND
        finally:
            await store.close()

    asyncio.run(go())


async def _responses(path: str) -> tuple[Responses, CollectorRegistry]:
    registry = CollectorRegistry()
    responses = Responses(SQLiteStore(path, Retention()), None, None, None, registry)
    await responses.start()
    return responses, registry


def _errors(registry: CollectorRegistry, operation: str) -> float:
    return registry.get_sample_value("gateway_responses_store_errors_total",
                                     {"operation": operation}) or 0.0


def test_turns_during_a_lock_are_served_within_the_deadline_and_counted(tmp_path):
    """Each turn begins (its record refused, counted) and ends without waiting a second
    deadline for a final save that has no in_progress record to race."""
    path = str(tmp_path / "responses.sqlite3")
    body = orjson.dumps({"model": "m", "input": "hi"})

    async def go() -> None:
        responses, registry = await _responses(path)
        try:
            with locked(path):
                began = await all_within(
                    [begin(responses, "t", body) for _ in range(AT_ONCE)])
                assert [took < BOUND for _, took in began] == [True] * AT_ONCE
                turns = [turn for turn, _ in began]
                assert not any(turn.kept for turn in turns)
                ended = await all_within([responses.keep(turn, {
                    "id": turn.rid, "status": "completed", "output": []}) for turn in turns])
                assert [took < 0.5 for _, took in ended] == [True] * AT_ONCE
            assert _errors(registry, "start") == AT_ONCE
        finally:
            await responses.stop()

    asyncio.run(go())


@pytest.mark.parametrize("operation", ["cancel", "previous"])
def test_reads_and_cancels_during_a_lock_are_answered_within_the_deadline(tmp_path,
                                                                        operation):
    """A cancel of a running response (its swap waits on the lock) is 503 within the
    deadline; a turn continuing one is served or 503 within it, never held for the lock."""
    path = str(tmp_path / "responses.sqlite3")

    async def go() -> None:
        responses, registry = await _responses(path)
        try:
            first = await begin(responses, "t", b'{"model": "m", "input": "hi"}')
            if operation == "previous":  # finished, so a next turn may follow it
                await responses.keep(first, {"id": first.rid, "status": "completed"})
            body = orjson.dumps({"model": "m", "input": "on", "previous_response_id": first.rid})
            work = (responses.cancel("t", first.rid) if operation == "cancel"
                    else begin(responses, "t", body))
            with locked(path):
                [(outcome, took)] = await all_within([work])
            assert took < BOUND
            if operation == "cancel":
                assert isinstance(outcome, StoreDown) and _errors(registry, "cancel") == 1
            else:  # its history read, served, its own record refused
                assert outcome.previous == first.rid and not outcome.kept
                assert _errors(registry, "start") == 1
        finally:
            await responses.stop()

    asyncio.run(go())
