"""A job ends, and leaves `state.jobs`, however early its task is stopped: in process, no
sockets (the flows' bookkeeping on its own)."""

from __future__ import annotations

import asyncio

import pytest

from backends.sim.config import config_from_args
from backends.sim.flows import abort, interrupt, launch
from backends.sim.job import ItemSpec, Job
from backends.sim.state import SimState


def _job(rid: str) -> Job:
    return Job(ItemSpec(index=0, rid=rid, input_ids=[1, 2, 3], text=None, max_new_tokens=4))


@pytest.mark.parametrize("stop", ["client-gone", "abort-request"])
def test_a_job_stopped_before_its_first_step_leaves_the_table(stop):
    """Regression: a task cancelled before its first step never ran `run_job`, nor its
    `finally`, so the job stayed in `state.jobs` for good (a decode sim's `in_flight` stuck
    at 1 after the gateway closed the leg at once)."""

    async def scenario() -> None:
        state = SimState.build(config_from_args(["--fast"]))
        await state.start()
        try:
            job = _job(f"early-{stop}")
            task = launch(state, job, "generate")
            if stop == "client-gone":
                interrupt(job)
            else:
                assert abort(state, job.spec.rid, abort_all=False) == 1
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 2)
            await asyncio.sleep(0)  # the task's done callbacks run one loop turn later
            assert state.jobs == {}
            assert job.done  # a writer waiting on it is woken
            outcome = "aborted" if stop == "abort-request" else "cancelled"
            assert state.stats.outcomes[outcome] == 1
        finally:
            await state.stop()

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_job_that_ran_is_removed_once():
    """The ordinary path is unchanged: a job served to its end leaves the table, counted
    once as completed."""

    async def scenario() -> None:
        state = SimState.build(config_from_args(["--fast"]))
        await state.start()
        try:
            job = _job("ran")
            await asyncio.wait_for(launch(state, job, "generate"), 5)
            await asyncio.sleep(0)
            assert state.jobs == {} and job.finish_reason is not None
            assert state.stats.outcomes["completed"] == 1
            assert sum(state.stats.outcomes.values()) == 1
        finally:
            await state.stop()

    asyncio.run(asyncio.wait_for(scenario(), 10))
