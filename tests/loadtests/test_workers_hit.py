"""loadtests.workers_hit: the plan is the issue's case, the same for every worker count."""

from __future__ import annotations

from loadtests.workers_hit import chats_plan


def test_the_plan_is_24_chats_of_6_turns_and_repeats_per_seed():
    plan = chats_plan(24, 6, seed=0, think=1.0)
    assert len(plan.conversations) == 24
    assert all(len(c.users) == 6 and len(c.thinks) == 6 for c in plan.conversations)
    assert all(0.0 <= c.start < 4.0 for c in plan.conversations)
    assert chats_plan(24, 6, seed=0, think=1.0) == plan
    assert chats_plan(24, 6, seed=1, think=1.0) != plan
