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


class SteppedLoop:
    """A loop clock the test moves: `call_at` handles run when the test says, so lateness is
    measured against the clock and not against this machine's load."""

    def __init__(self) -> None:
        self.now = 0.0
        self.handles: list[SteppedHandle] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when, callback, *args):
        handle = SteppedHandle(when, callback, args)
        self.handles.append(handle)
        return handle

    def run_next(self, lag: float) -> bool:
        """Move the clock to the earliest live handle plus `lag` and run it."""
        live = [h for h in self.handles if not h.cancelled]
        if not live:
            return False
        handle = min(live, key=lambda h: h.when)
        self.handles.remove(handle)
        self.now = max(self.now, handle.when + lag)
        handle.callback(*handle.args)
        return True


class SteppedHandle:
    def __init__(self, when, callback, args) -> None:
        self.when, self.callback, self.args = when, callback, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("max_lag", [0.0, 0.05])
def test_each_deadline_fires_once_not_early_and_at_the_first_tick_after_its_bucket(max_lag):
    """Never early, and never held back: at every tick, each deadline whose bucket has ended
    fires, whatever the loop's own lag (up to 50 ms here) on a loaded machine."""
    resolution = 0.01
    loop = SteppedLoop()
    timers = Timers(resolution=resolution)
    timers._loop = loop
    rng = random.Random(7)
    wanted = {i: rng.uniform(0.0, 0.2) for i in range(300)}
    fired: dict[int, float] = {}
    for i, when in wanted.items():
        timers.at(when, lambda i=i: fired.setdefault(i, loop.time()) and None)
    ticks = []
    while loop.run_next(rng.uniform(0.0, max_lag)):
        ticks.append(loop.now)
        overdue = [i for i, when in wanted.items()
                   if math.ceil(when / resolution) * resolution <= loop.now and i not in fired]
        assert not overdue, (loop.now, overdue[:5])
    assert set(fired) == set(wanted)
    for i, when in wanted.items():
        assert fired[i] >= when - 0.0011  # uvloop's clock counts milliseconds
    assert len(ticks) <= 21  # one loop timer per bucket at most, not one per deadline
    assert len(timers) == 0


def test_deadlines_fire_on_a_real_loop_and_not_early():
    async def main():
        timers = Timers(resolution=0.01)
        loop = asyncio.get_running_loop()
        fired: dict[int, float] = {}
        start = loop.time()
        wanted = {i: start + i * 0.001 for i in range(100)}
        for i, when in wanted.items():
            timers.at(when, lambda i=i: fired.setdefault(i, loop.time()) and None)
        await asyncio.sleep(0.2)
        assert set(fired) == set(wanted)
        assert all(fired[i] >= when - 0.0011 for i, when in wanted.items())
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
