"""Trailing prefill answers: each gets `timeout` seconds after its decode, then is stopped."""

from __future__ import annotations

import asyncio

from gateway.dispatch.prefill_tails import PrefillTails
from gateway.timers import Timers


def run(coro):
    return asyncio.run(coro)


async def _forever() -> None:
    await asyncio.Event().wait()


def test_a_tail_that_ends_in_time_is_forgotten_and_never_expires() -> None:
    async def main():
        expired = []
        tails = PrefillTails(Timers(0.005), 0.05, lambda attempt, task: expired.append(attempt))
        task = asyncio.get_running_loop().create_task(asyncio.sleep(0.01))
        task.add_done_callback(tails.ended)  # as pd's _PrefillWatch does
        tails.add("a", task)
        assert len(tails) == 1
        await task
        await asyncio.sleep(0)  # the done-callback runs
        assert len(tails) == 0
        await asyncio.sleep(0.1)
        return expired

    assert run(main()) == []


def test_tails_expire_in_order_each_after_its_own_timeout() -> None:
    async def main():
        loop = asyncio.get_running_loop()
        expired = []

        def stop(attempt, task):
            expired.append((attempt, loop.time()))
            task.cancel()

        tails = PrefillTails(Timers(0.005), 0.1, stop)
        first, second = loop.create_task(_forever()), loop.create_task(_forever())
        added = loop.time()
        tails.add("first", first)
        await asyncio.sleep(0.05)
        tails.add("second", second)
        await asyncio.sleep(0.25)
        assert first.cancelled() and second.cancelled()
        return added, expired

    added, expired = run(main())
    assert [name for name, _ in expired] == ["first", "second"]
    first_at, second_at = expired[0][1] - added, expired[1][1] - added
    assert 0.1 <= first_at + 0.002 < 1.0  # never early (up to the timer's 1 ms clock)
    assert 0.15 <= second_at + 0.002 < 1.0  # its own timeout, not the first one's


def test_a_task_that_ended_without_telling_is_not_stopped() -> None:
    async def main():
        expired = []
        tails = PrefillTails(Timers(0.005), 0.02, lambda attempt, task: expired.append(attempt))
        task = asyncio.get_running_loop().create_task(asyncio.sleep(0))
        tails.add("done", task)
        await task
        await asyncio.sleep(0.06)
        return expired, len(tails)

    assert run(main()) == ([], 0)


def test_cancel_all_hands_back_the_running_tasks_and_stops_the_sweep() -> None:
    async def main():
        expired = []
        tails = PrefillTails(Timers(0.005), 0.02, lambda attempt, task: expired.append(attempt))
        task = asyncio.get_running_loop().create_task(_forever())
        tails.add("a", task)
        left = tails.cancel_all()
        await asyncio.sleep(0.06)
        task.cancel()
        return left == [task], expired, len(tails)

    assert run(main()) == (True, [], 0)
