"""`--max-queue` with `--workers`: the bound holds for the gateway as a whole. Each test plays
two workers in one process, two `SharedState` views of one block (as the real workers attach
it). Before the fix each worker bounded only its own queue: 2 workers held twice the queue."""

from __future__ import annotations

import asyncio
import time
from multiprocessing import resource_tracker

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission.slots import Admission
from gateway.admission.tenancy import Tenant
from gateway.config.tenants import BATCH, INTERACTIVE, STANDARD, TenantSettings
from gateway.errors import TooManyRequests
from gateway.observability.metrics import Metrics
from gateway.processes.shared_state import SharedState
from gateway.servers.pool import ServerPool


@pytest.fixture
def views(tmp_path):
    """Two views of one block of 2 workers: what the supervisor creates, what a worker attaches."""
    name, lock = f"gw-queue-{time.monotonic_ns()}", str(tmp_path / "lock")
    created = SharedState(name, 2, 0, lock, create=True)
    attached = SharedState(name, 2, 0, lock)
    # attaching let go of the resource tracker's registration, which is this process's (the
    # creator's) here: take it again, so that the unlink below finds it
    resource_tracker.register(created.shm._name, "shared_memory")
    yield created, attached
    attached.close()
    created.close(unlink=True)


def admission(state: SharedState, worker: int, limit: int = 1, queue: int = 2) -> Admission:
    return Admission(limit, queue, 5, Metrics(CollectorRegistry(), ServerPool()),
                     shared=(state, worker))


def test_the_waiter_count_is_gateway_wide_and_taken_under_the_lock(views):
    one, two = views
    assert one.try_queue(0, 3, 0) and one.try_queue(0, 3, 1)
    assert two.queued() == 2  # the other view sees worker 0's waiters
    assert two.try_queue(1, 3, 0)
    assert not two.try_queue(1, 3, 1) and not one.try_queue(0, 3, 2)  # 3 wait: full
    one.publish_waiting(0, None, 0.0, 0)  # worker 0's waiters left (granted, gone)
    assert two.queued() == 1 and two.try_queue(1, 3, 1)
    two.forget_worker(1)  # worker 1 died: its waiters stop counting
    assert one.queued() == 0


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _start(adm: Admission, klass: int, errors: list, order: list, name: str):
    async def one():
        try:
            await adm.acquire(Tenant("t", TenantSettings()), klass)
        except TooManyRequests as exc:
            errors.append((name, exc))
            return
        order.append(name)

    task = asyncio.get_running_loop().create_task(one())
    await _settle()
    return task


def test_two_workers_hold_one_queue_and_nothing_leaks(views):
    """limit 1 + queue 2 gateway-wide: 6 arrivals spread over 2 workers, 3 let in at once."""
    async def go():
        state = views[0]
        workers = [admission(views[0], 0), admission(views[1], 1)]
        errors, order = [], []
        tasks = [await _start(workers[i % 2], STANDARD, errors, order, f"r{i}") for i in range(6)]
        assert len(order) == 1 and len(errors) == 3  # 1 running + 2 waiting, 3 refused
        assert state.active() == 1 and state.queued() == 2
        assert {str(e) for _, e in errors} == {
            "gateway is at capacity and its queue is full; retry later"}
        for _ in range(3):  # each finishing request hands its slot on
            holder = next(w for w in workers if w.active)
            holder.release()
            for _ in range(200):
                await asyncio.sleep(0.005)
                if sum(w.active for w in workers) or len(order) == 3:
                    break
        await asyncio.gather(*tasks)
        assert len(order) == 3 and state.active() == 0 and state.queued() == 0

    asyncio.run(asyncio.wait_for(go(), 10))


def test_a_shed_evicts_only_its_own_workers_lower_waiter(views):
    """Queue full gateway-wide: an interactive arrival sheds a batch waiter of its own
    worker, but is refused when the only batch waiter is in the other worker."""
    async def go():
        state = views[0]
        here, there = admission(views[0], 0), admission(views[1], 1)
        errors, order = [], []
        await _start(here, STANDARD, errors, order, "holder")
        await _start(there, BATCH, errors, order, "batch-there")
        await _start(here, BATCH, errors, order, "batch-here")
        assert state.queued() == 2
        await _start(here, INTERACTIVE, errors, order, "urgent-here")
        assert [n for n, _ in errors] == ["batch-here"]  # shed for the arrival
        await _start(there, STANDARD, errors, order, "standard-there")  # sheds batch-there
        await _start(here, INTERACTIVE, errors, order, "urgent-late")
        assert [n for n, _ in errors] == ["batch-here", "batch-there", "urgent-late"]
        assert state.queued() == 2  # the bound held through every shed

    asyncio.run(asyncio.wait_for(go(), 10))
