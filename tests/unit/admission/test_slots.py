"""Admission: the concurrency limit with its fair queue, deadlines, shedding and departures."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission.slots import Admission
from gateway.admission.tenancy import Tenant
from gateway.config.tenants import BATCH, INTERACTIVE, STANDARD, TenantSettings
from gateway.errors import GatewayTimeout, ServiceUnavailable, TooManyRequests
from gateway.observability.metrics import Metrics
from gateway.processes.shared_state import SharedState
from gateway.servers.pool import ServerPool


def metrics():
    return Metrics(CollectorRegistry(), ServerPool())


def tenant(name: str, weight: float = 1.0) -> Tenant:
    return Tenant(name, TenantSettings(weight=weight))


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 10))


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


class Requests:
    """Tasks that take a slot, note the order they got it, and hold it until released."""

    def __init__(self, adm: Admission) -> None:
        self.adm = adm
        self.order: list[str] = []
        self.errors: dict[str, Exception] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, name: str, who: Tenant | None = None, klass: int = STANDARD,
              deadline: float | None = None) -> asyncio.Task:
        async def one():
            try:
                await self.adm.acquire(who, klass, deadline)
            except (TooManyRequests, ServiceUnavailable, GatewayTimeout) as exc:
                self.errors[name] = exc
                return
            self.order.append(name)

        task = self.tasks[name] = asyncio.get_running_loop().create_task(one())
        return task


def test_queue_full_and_queue_timeout():
    async def go():
        adm = Admission(max_concurrency=1, max_queue=1, queue_timeout=0.2, metrics=metrics())
        reqs = Requests(adm)
        reqs.start("holder")
        await settle()
        reqs.start("waiter")
        await settle()
        with pytest.raises(TooManyRequests) as full:
            await adm.acquire()
        assert full.value.headers["retry-after"] == "1"
        started = time.monotonic()
        await reqs.tasks["waiter"]
        assert 0.19 <= time.monotonic() - started < 1.0
        assert isinstance(reqs.errors["waiter"], ServiceUnavailable)
        assert reqs.errors["waiter"].headers["retry-after"] == "2"
        assert adm.active == 1 and adm.queued == 0
        adm.release()
        assert adm.active == 0

    run(go())


def test_classes_are_served_in_order_and_the_lowest_is_shed_first():
    async def go():
        adm = Admission(max_concurrency=1, max_queue=3, queue_timeout=5, metrics=metrics())
        reqs = Requests(adm)
        team = tenant("team")
        reqs.start("holder", team)
        await settle()
        for name, klass in (("batch1", BATCH), ("std", STANDARD), ("batch2", BATCH)):
            reqs.start(name, team, klass)
            await settle()
        reqs.start("inter", team, INTERACTIVE)  # the queue is full: the youngest batch goes
        await settle()
        shed = reqs.errors.pop("batch2")
        assert isinstance(shed, TooManyRequests) and shed.headers["retry-after"] == "5"
        assert "shed" in shed.message
        reqs.start("batch3", team, BATCH)  # full, and nothing below batch: refused itself
        await settle()
        assert isinstance(reqs.errors.pop("batch3"), TooManyRequests)
        for _ in range(3):
            adm.release()
            await settle()
        assert reqs.order == ["holder", "inter", "std", "batch1"]
        assert not reqs.errors and adm.queued == 0 and adm.active == 1

    run(go())


def test_slots_go_to_tenants_by_weight():
    async def go():
        adm = Admission(max_concurrency=1, max_queue=200, queue_timeout=5, metrics=metrics())
        reqs = Requests(adm)
        heavy, light = tenant("heavy", 3), tenant("light", 1)
        reqs.start("holder", light)
        await settle()
        for n in range(40):
            reqs.start(f"heavy{n}", heavy)
            reqs.start(f"light{n}", light)
        await settle()
        for _ in range(40):
            adm.release()
            await settle()
        served = reqs.order[1:]
        assert len(served) == 40
        assert 28 <= sum(name.startswith("heavy") for name in served) <= 32  # 3 : 1

    run(go())


def test_the_clients_deadline_ends_the_wait_and_no_work_starts_after_it():
    async def go():
        adm = Admission(max_concurrency=1, max_queue=5, queue_timeout=5, metrics=metrics())
        loop = asyncio.get_running_loop()
        with pytest.raises(GatewayTimeout):  # already over on arrival: not even a free slot
            await adm.acquire(None, STANDARD, loop.time() - 0.001)
        assert adm.active == 0
        reqs = Requests(adm)
        reqs.start("holder")
        await settle()
        started = time.monotonic()
        reqs.start("hurried", deadline=loop.time() + 0.15)
        reqs.start("patient")
        await reqs.tasks["hurried"]
        assert 0.14 <= time.monotonic() - started < 1.0  # its deadline, not the queue's 5 s
        assert isinstance(reqs.errors["hurried"], GatewayTimeout)
        adm.release()
        await settle()
        assert reqs.order == ["holder", "patient"]

    run(go())


def test_a_deadline_due_at_grant_time_gets_no_slot():
    async def go():
        adm = Admission(max_concurrency=1, max_queue=5, queue_timeout=5, metrics=metrics())
        loop = asyncio.get_running_loop()
        reqs = Requests(adm)
        reqs.start("holder")
        await settle()
        reqs.start("late", deadline=loop.time() + 0.05)
        reqs.start("next")
        await settle()
        time.sleep(0.08)  # the loop is blocked: the deadline passes before its timer runs
        adm.release()  # the slot must skip "late"
        await settle()
        assert reqs.order == ["holder", "next"]
        assert isinstance(reqs.errors["late"], GatewayTimeout)

    run(go())


def test_a_cancelled_waiter_leaves_at_once_and_a_granted_one_passes_its_slot_on():
    async def go():
        adm = Admission(max_concurrency=1, max_queue=5, queue_timeout=5, metrics=metrics())
        reqs = Requests(adm)
        reqs.start("holder")
        await settle()
        gone = reqs.start("gone")
        reqs.start("granted-then-gone")
        reqs.start("last")
        await settle()
        assert adm.queued == 3
        gone.cancel()  # the client left while queued
        await settle()
        assert adm.queued == 2 and gone.cancelled()
        adm.release()  # the slot goes to "granted-then-gone"...
        reqs.tasks["granted-then-gone"].cancel()  # ...which is cancelled before it resumes
        await settle()
        assert reqs.order == ["holder", "last"]
        assert adm.active == 1 and adm.queued == 0

    run(go())


@pytest.mark.parametrize("refusal", ["queue_timeout", "shed"])
def test_a_waiter_refused_and_cancelled_in_the_same_pass_frees_no_slot(refusal):
    """A queued request refused (its queue timeout, or shed for a more urgent one) whose
    client leaves before its task resumes never held a slot: the limit stays whole (before:
    it released one, `active` went to -1 and a limit of 1 served 2 at once)."""
    async def go():
        adm = Admission(max_concurrency=1, max_queue=1, queue_timeout=5, metrics=metrics())
        reqs = Requests(adm)
        reqs.start("holder")
        await settle()
        refused = reqs.start("refused", klass=BATCH)
        await settle()
        if refusal == "shed":
            reqs.start("urgent", klass=INTERACTIVE)
            await asyncio.sleep(0)  # the arrival sheds the queued one (its future fails)
        else:
            waiter, = (w for flow in adm._queue._flows.values() for cls in flow.classes
                       for w in cls)
            adm._expire(waiter)  # its timer fires
        refused.cancel()  # the client leaves in the same pass
        await settle()
        assert adm.active == 1
        adm.release()  # the holder ends: its slot goes to the next waiter, or back
        await settle()
        assert adm.active == (1 if refusal == "shed" else 0)
        assert reqs.order == (["holder", "urgent"] if refusal == "shed" else ["holder"])
        reqs.start("first")
        reqs.start("second")
        await settle()
        assert adm.active == 1 and adm.queued == 1  # the limit of 1 holds

    run(go())


def test_with_workers_a_more_urgent_waiter_elsewhere_gets_the_freed_slot(tmp_path):
    async def go(state: SharedState):
        one = Admission(1, 10, 5, metrics(), shared=(state, 0))
        two = Admission(1, 10, 5, metrics(), shared=(state, 1))
        first, second = Requests(one), Requests(two)
        first.start("holder")
        await settle()
        first.start("batch-here", klass=BATCH)
        await settle()
        second.start("interactive-there", klass=INTERACTIVE)
        await asyncio.sleep(0.02)
        assert not second.order  # all slots are busy in worker 0
        one.release()  # worker 0 has a batch waiter of its own, but yields the slot
        for _ in range(100):
            await asyncio.sleep(0.005)
            if second.order:
                break
        assert second.order == ["interactive-there"] and first.order == ["holder"]
        two.release()  # now worker 0's batch waiter is the only one: it gets the slot
        for _ in range(100):
            await asyncio.sleep(0.005)
            if len(first.order) == 2:
                break
        assert first.order == ["holder", "batch-here"]
        assert state.active() == 1

    state = SharedState(f"gw-test-{time.monotonic_ns()}", 2, 0, str(tmp_path / "lock"),
                        create=True)
    try:
        run(go(state))
    finally:
        state.close(unlink=True)
