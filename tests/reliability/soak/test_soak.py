"""The compound-fault soak, short: a few seeds of overlapping faults over a real gateway with
its default flags; every request must get a complete, well-formed answer with the asked token
count within the latency bound, and nothing may be left behind.

A failing seed prints its report (failures by kind, examples with the faults around them) and
the command that replays its schedule exactly.
"""

from __future__ import annotations

import pytest

from tests.reliability.soak.runner import SoakOptions, run_soak, schedule_for
from tests.reliability.soak.schedule import KINDS

SEEDS = (1, 2, 3)
SECONDS = 30.0

pytestmark = pytest.mark.timeout(240)


def test_the_seed_set_exercises_every_fault_kind():
    kinds = {f.kind for seed in SEEDS for f in schedule_for(seed, SECONDS).faults}
    assert kinds == set(KINDS)


def test_a_schedule_is_a_function_of_its_seed():
    assert schedule_for(7, SECONDS) == schedule_for(7, SECONDS)
    assert schedule_for(7, SECONDS) != schedule_for(8, SECONDS)


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_soak_seed_has_no_failures(seed, tmp_path):
    result = run_soak(seed, tmp_path, SoakOptions(seconds=SECONDS))
    print(result.render())
    assert not result.executor_errors, result.render()
    assert result.requests >= SECONDS * 5, result.render()  # the traffic really flowed
    assert result.failures == 0, result.render()
