"""Admission: the concurrency limit with its queue, API keys and per-key rate limits."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission import Admission, KeyChecker
from gateway.errors import ServiceUnavailable, TooManyRequests, Unauthorized
from gateway.metrics import Metrics
from gateway.workers import WorkerPool


def metrics():
    return Metrics(CollectorRegistry(), WorkerPool())


@pytest.mark.parametrize(
    "authorization, header, error",
    [
        (None, None, "missing"),
        ("Bearer nope", None, "invalid"),
        ("Basic k1", None, "missing"),
        ("Bearer k1", None, None),
        ("bearer k2", None, None),
        (None, "k2", None),
    ],
    ids=["none", "wrong", "not-bearer", "bearer", "lowercase-bearer", "x-api-key"],
)
def test_keys(authorization, header, error):
    checker = KeyChecker(("k1", "k2"))
    if error:
        with pytest.raises(Unauthorized, match=error):
            checker.check(authorization, header)
    else:
        checker.check(authorization, header)


def test_open_when_no_keys():
    KeyChecker(()).check(None, None)


def test_rate_limit_per_key_with_burst_and_refill():
    now = [0.0]
    checker = KeyChecker(("a", "b"), rate=2.0, burst=3, metrics=metrics(), clock=lambda: now[0])
    for _ in range(3):
        checker.check("Bearer a")
    with pytest.raises(TooManyRequests) as info:
        checker.check("Bearer a")
    assert int(info.value.headers["retry-after"]) >= 1
    checker.check("Bearer b")  # another key has its own bucket
    now[0] += 0.5  # one token back at 2/s
    checker.check("Bearer a")
    with pytest.raises(TooManyRequests):
        checker.check("Bearer a")


def test_queue_full_and_queue_timeout():
    async def go():
        adm = Admission(max_concurrency=1, max_queue=1, queue_timeout=0.2, metrics=metrics())
        release = asyncio.Event()
        order = []

        async def holder():
            async with adm.slot():
                order.append("holder")
                await release.wait()

        async def waiter():
            async with adm.slot():
                order.append("waiter")

        h = asyncio.create_task(holder())
        await asyncio.sleep(0)
        w = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        with pytest.raises(TooManyRequests):
            async with adm.slot():
                pass
        release.set()
        await asyncio.gather(h, w)
        assert order == ["holder", "waiter"]
        assert adm.active == 0

        release.clear()
        h = asyncio.create_task(holder())
        await asyncio.sleep(0)
        with pytest.raises(ServiceUnavailable):
            async with adm.slot():
                pass
        release.set()
        await h
        assert adm.active == 0 and adm.queued == 0

    asyncio.run(asyncio.wait_for(go(), 5))
