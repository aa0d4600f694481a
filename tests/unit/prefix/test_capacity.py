"""Capacity-aware cache decisions: per-target budgets, a hot shared prefix spreading over
targets whose caches are full, continuations staying with their history, grouping after a copy,
and unchanged behaviour while capacities are unknown."""

from __future__ import annotations

import time

import pytest

from gateway.policies.cache_aware import CacheAwareOptions, CacheAwarePolicy
from gateway.policies.prefix_cache import PrefixCacheOptions, PrefixCachePolicy
from gateway.prefix.tree import CHARS_PER_TOKEN
from tests.unit.builders import chat, generate_ids, server

SYSTEM = ("system", "You are the support assistant of a large shop. " * 30)  # ~1,400 chars
CAPACITY = 1000  # tokens per target: 4,000 characters of rendered chat


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "monotonic", fake)
    return fake


def turns(name: str, count: int, words: int = 80) -> list:
    """The messages of conversation `name` up to its `count`-th user turn."""
    messages = [SYSTEM]
    for i in range(count):
        messages.append(("user", f"{name} asks {i}: " + f"{name} " * words))
        if i < count - 1:
            messages.append(("assistant", f"answer {i} to {name}"))
    return messages


def targets(capacity: int = CAPACITY) -> list:
    return [server(f"http://10.0.0.{i}:30000", load={"max_total_tokens": capacity})
            for i in range(1, 4)]


def serve(policy, target, name: str, count: int) -> None:
    """Dispatch turn `count` of conversation `name` to `target` (as the gateway would)."""
    policy.on_dispatch(target, chat(*turns(name, count)))


def fill(policy, clock: Clock, target, candidates: list) -> None:
    """Conversations of SYSTEM on `target` up to its capacity, used within the last second;
    "learner" taught the policy that turns come back about 2 s apart."""
    serve(policy, target, "learner", 1)
    clock.now += 2.0
    assert policy.pick(candidates, chat(*turns("learner", 2))) is target
    serve(policy, target, "learner", 2)
    for name in ("ann", "bob", "cid", "dan"):
        clock.now += 0.2
        serve(policy, target, name, 2)
    assert policy.tree.server_size(target.url) > 0.8 * CAPACITY * CHARS_PER_TOKEN


@pytest.mark.parametrize("policy_class", [CacheAwarePolicy, PrefixCachePolicy],
                         ids=["cache_aware", "prefix_cache"])
def test_budget_bounds_each_targets_part_of_the_tree(policy_class) -> None:
    policy = policy_class("prefill")
    a, b, _ = targets()
    for i in range(40):
        policy.on_dispatch(a if i % 2 else b, generate_ids(list(range(i * 500, i * 500 + 300))))
    sizes = policy.tree.server_sizes()
    assert max(sizes.values()) <= CAPACITY * CHARS_PER_TOKEN
    assert sum(sizes.values()) > CAPACITY * CHARS_PER_TOKEN  # something was kept on each


def test_cache_tokens_option_overrides_v1_loads() -> None:
    policy = CacheAwarePolicy("prefill", CacheAwareOptions(cache_tokens=100))
    a, _, _ = targets()
    policy.on_dispatch(a, generate_ids(list(range(1000))))
    assert policy.tree.server_size(a.url) == 100 * CHARS_PER_TOKEN


def test_hot_shared_prefix_spreads_when_its_holder_is_full(clock: Clock) -> None:
    policy = CacheAwarePolicy("prefill")
    a, b, c = targets()
    fill(policy, clock, a, [a, b, c])
    clock.now += 0.5
    new = policy.pick([a, b, c], chat(*turns("eve", 1)))
    assert new is not a
    assert policy.stats()["decisions"]["capacity"] == 1
    policy.on_dispatch(new, chat(*turns("eve", 1)))
    # a later conversation of the same prompt groups with the copy, which has room
    assert policy.pick([a, b, c], chat(*turns("fay", 1))) is new
    # and the conversations held by the full target stay there
    assert policy.pick([a, b, c], chat(*turns("dan", 3))) is a


def test_full_holder_of_old_content_still_takes_the_branch(clock: Clock) -> None:
    """Content unused for several reuse intervals is what an LRU may evict: room."""
    policy = CacheAwarePolicy("prefill")
    a, b, c = targets()
    fill(policy, clock, a, [a, b, c])
    clock.now += 60.0
    assert policy.pick([a, b, c], chat(*turns("eve", 1))) is a


@pytest.mark.parametrize("capacity", [0, 10_000_000], ids=["unknown", "ample"])
def test_without_capacity_pressure_the_best_match_wins_as_before(clock: Clock,
                                                                 capacity: int) -> None:
    policy = CacheAwarePolicy("prefill")
    a, b, c = targets(capacity)
    fill(policy, clock, a, [a, b, c])
    clock.now += 0.5
    assert policy.pick([a, b, c], chat(*turns("eve", 1))) is a
    assert policy.stats()["decisions"]["capacity"] == 0


def test_continuation_stays_with_its_history_not_a_tie_band_holder(clock: Clock) -> None:
    """Turn 2 matches b (turn 1 there) and a (the system prompt, within 5 % of it): the
    conversation stays on b, even though a is less loaded."""
    policy = CacheAwarePolicy("prefill")
    a, b, c = targets(0)
    serve(policy, a, "other", 1)
    first = [SYSTEM, ("user", "hi")]
    policy.on_dispatch(b, chat(*first))
    b.in_flight = 3
    clock.now += 2.0
    assert policy.pick([a, b, c], chat(*first, ("assistant", "hello"), ("user", "ok"))) is b


def test_new_prompt_goes_where_there_is_room(clock: Clock) -> None:
    policy = CacheAwarePolicy("prefill")
    a, b, c = targets()
    policy.on_servers_changed([a, b, c])
    fill(policy, clock, a, [a, b, c])
    serve(policy, b, "zed", 1)
    fresh = chat(("system", "A different assistant for the warehouse. " * 40), ("user", "go"))
    assert policy.pick([a, b, c], fresh) is c
    assert policy.stats()["decisions"]["placement"] >= 1


def test_prefix_cache_shares_the_decision(clock: Clock) -> None:
    policy = PrefixCachePolicy("prefill", PrefixCacheOptions(default_port=0))
    a, b, c = targets()
    fill(policy, clock, a, [a, b, c])
    clock.now += 0.5
    assert policy.pick([a, b, c], chat(*turns("eve", 1))) is not a
    assert policy.stats()["decisions"]["capacity"] == 1
