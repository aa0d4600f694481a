"""Admission: the concurrency limit with its queue."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission import Admission
from gateway.errors import ServiceUnavailable, TooManyRequests
from gateway.metrics import Metrics
from gateway.workers import WorkerPool


def metrics():
    return Metrics(CollectorRegistry(), WorkerPool())


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
