"""The coarse deadlines of gateway/timers.py and the `Deadline` of gateway/cancel.py."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import uvloop

from gateway.cancel import Deadline, Expired, Interrupt
from gateway.timers import Timers


def run(coro):
    return uvloop.run(coro)


def test_each_deadline_fires_once_not_early_and_at_most_a_bucket_late():
    """Late by at most a bucket: each deadline fires no later than a plain loop timer set
    for the end of its bucket, whatever the loop's own lag on a loaded machine."""
    async def main():
        resolution = 0.01
        timers = Timers(resolution=resolution)
        loop = asyncio.get_running_loop()
        fired: dict[int, float] = {}
        reference: dict[int, float] = {}
        start = loop.time()
        rng = random.Random(7)
        wanted = {i: start + rng.uniform(0.0, 0.2) for i in range(300)}
        for i, when in wanted.items():
            timers.at(when, lambda i=i: fired.setdefault(i, loop.time()) and None)
            bucket_end = math.ceil(when / resolution) * resolution
            loop.call_at(bucket_end, lambda i=i: reference.setdefault(i, loop.time()) and None)
        await asyncio.sleep(0.3)
        assert set(fired) == set(wanted) == set(reference)
        for i, when in wanted.items():
            assert fired[i] >= when - 0.0011  # uvloop's clock counts milliseconds
            assert fired[i] <= reference[i] + 0.002, (fired[i] - when, reference[i] - when)
        assert len(timers) == 0
    run(main())


def test_cancelled_deadlines_never_fire_and_leave_nothing_behind():
    async def main():
        timers = Timers(resolution=0.005)
        fired = []
        keep = []
        for i in range(1000):
            timer = timers.after(0.02 + i * 0.00001, fired.append, i)
            if i % 10:
                timer.cancel()
                timer.cancel()  # idempotent
            else:
                keep.append(i)
        assert len(timers) == len(keep)
        await asyncio.sleep(0.08)
        assert fired == keep
        assert len(timers) == 0 and not timers._buckets
    run(main())


def test_an_earlier_deadline_armed_later_still_fires_first():
    async def main():
        timers = Timers(resolution=0.01)
        order = []
        timers.after(0.15, order.append, "late")
        timers.after(0.03, order.append, "early")
        await asyncio.sleep(0.06)
        assert order == ["early"]
        await asyncio.sleep(0.15)
        assert order == ["early", "late"]
    run(main())


def test_a_callback_may_arm_another_deadline():
    async def main():
        timers = Timers(resolution=0.01)
        loop = asyncio.get_running_loop()
        seen = []

        def again(n):
            seen.append(n)
            if n < 3:
                timers.after(0.01, again, n + 1)
        timers.after(0.01, again, 0)
        deadline = loop.time() + 1.0
        while len(seen) < 4 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert seen == [0, 1, 2, 3]
    run(main())


def test_deadline_interrupts_the_waiting_task_with_expired():
    async def main():
        timers = Timers()
        interrupt = Interrupt()
        loop = asyncio.get_running_loop()
        started = loop.time()
        Deadline(timers, interrupt, started + 0.05)
        with pytest.raises(Expired):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                if (reason := interrupt.reason()) is not None:
                    raise reason from None
                raise
        assert 0.045 <= loop.time() - started < 1.0
        assert asyncio.current_task().cancelling() == 0  # the cancellation was taken back
    run(main())


def test_deadline_moves_later_and_earlier_and_cancels():
    async def main():
        timers = Timers()
        loop = asyncio.get_running_loop()
        interrupt = Interrupt()
        now = loop.time()
        deadline = Deadline(timers, interrupt, now + 0.03)
        deadline.move(now + 0.3)  # later: no interrupt at 0.03
        await asyncio.sleep(0.08)
        assert not interrupt.fired
        deadline.move(loop.time() + 0.02)  # earlier again
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(1)
        assert isinstance(interrupt.reason(), Expired)

        other = Interrupt()
        cancelled = Deadline(timers, other, loop.time() + 0.02)
        cancelled.cancel()
        await asyncio.sleep(0.06)
        assert not other.fired
        assert len(timers) == 0
    run(main())
