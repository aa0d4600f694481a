"""The own client's pool bookkeeping (`http11_pool.HostPool`) at its races: a connection or a
place handed to a waiter that is cancelled before it runs must not be lost, and the count of
connections never passes the limit."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.upstream.errors import ConnectFailed
from gateway.upstream.http11_pool import HostPool
from tests.upstream.raw import run


class FakeTransport:
    def is_closing(self) -> bool:
        return False


class FakeConnection:
    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.closed = False
        self.idle_since = 0.0
        self.transport = FakeTransport()

    def close(self) -> None:
        self.closed = True
        self.pool.discard(self)


def test_a_connection_handed_to_a_cancelled_waiter_goes_back_to_the_pool():
    async def go():
        pool = HostPool("h", 1, "h:1", limit=1)
        connection = FakeConnection(pool)
        pool.active.add(connection)
        waiter = asyncio.ensure_future(pool.wait(5))
        await asyncio.sleep(0)
        pool.release(connection)  # handed over...
        waiter.cancel()  # ...and cancelled before the waiter ran
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert list(pool.idle) == [connection] and not pool.active and pool.size == 1
        assert pool.take_idle() is connection

    run(go())


def test_a_place_promised_to_a_cancelled_waiter_goes_to_the_next():
    async def go():
        pool = HostPool("h", 1, "h:1", limit=1)
        connection = FakeConnection(pool)
        pool.active.add(connection)
        first = asyncio.ensure_future(pool.wait(5))
        second = asyncio.ensure_future(pool.wait(5))
        await asyncio.sleep(0)
        connection.close()  # a place comes free: promised to the first waiter...
        first.cancel()  # ...who is cancelled: the place must pass to the second
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await asyncio.wait_for(second, 1) is None  # its turn to connect
        assert pool.pending == 1 and pool.size == 1

    run(go())


def test_waiters_fail_when_the_client_closes():
    async def go():
        pool = HostPool("h", 1, "h:1", limit=1)
        pool.active.add(FakeConnection(pool))
        waiter = asyncio.ensure_future(pool.wait(5))
        await asyncio.sleep(0)
        pool.fail_waiters(ConnectFailed("the client is closed"))
        with pytest.raises(ConnectFailed):
            await waiter
        assert not pool.waiters and pool.pending == 0

    run(go())


def test_random_schedules_never_exceed_the_limit_nor_lose_places():
    """Many tasks take, hold and give back connections (released, closed, or cancelled while
    waiting) in random order; the pool never counts more than its limit, and at the end every
    place is free again."""
    async def go():
        rng = random.Random(7)
        pool = HostPool("h", 1, "h:1", limit=3)
        peak = 0

        async def user() -> None:
            nonlocal peak
            for _ in range(30):
                connection = pool.take_idle()
                if connection is None and pool.size < pool.limit:
                    pool.pending += 1
                    await asyncio.sleep(0)  # "connecting"
                    pool.pending -= 1
                    connection = FakeConnection(pool)
                    pool.active.add(connection)
                elif connection is None:
                    try:
                        got = await pool.wait(0.05 if rng.random() < 0.2 else 5)
                    except TimeoutError:
                        continue
                    if got is None:
                        pool.pending -= 1
                        got = FakeConnection(pool)
                        pool.active.add(got)
                    connection = got
                peak = max(peak, pool.size)
                assert pool.size <= pool.limit
                for _ in range(rng.randrange(3)):
                    await asyncio.sleep(0)
                if rng.random() < 0.3:
                    connection.close()
                else:
                    pool.release(connection)

        await asyncio.gather(*(user() for _ in range(12)))
        assert peak == pool.limit
        assert not pool.active and pool.pending == 0 and not pool.waiters
        assert len(pool.idle) <= pool.limit

    run(go())
