"""cache_aware: full-history keys, the threshold, the tie band, the imbalance guard, removal."""

from __future__ import annotations

import pytest

from gateway.policies.cache_aware import CacheAwareOptions, CacheAwarePolicy
from gateway.request import RequestView
from tests.unit.builders import chat, generate_ids, server

SYSTEM = ("system", "You are a careful assistant. " * 20)  # ~600 characters, shared by all


def history(topic: str, turns: int) -> list[tuple[str, str]]:
    messages = [SYSTEM]
    for i in range(turns):
        messages += [("user", f"{topic} question {i}: " + topic * 30),
                     ("assistant", f"{topic} answer {i}: " + topic[::-1] * 30)]
    return messages


@pytest.mark.parametrize("order", ["ab", "ba"], ids=["workers_in_order", "workers_reversed"])
def test_conversations_follow_their_history_not_the_shared_system_prompt(order: str) -> None:
    policy = CacheAwarePolicy("prefill")
    a, b = server("a"), server("b")
    candidates = [a, b] if order == "ab" else [b, a]
    policy.on_dispatch(a, chat(*history("apples", 2)))
    policy.on_dispatch(b, chat(*history("boats", 2)))
    for turns in (3, 4):
        assert policy.pick(candidates, chat(*history("apples", turns))) is a
        assert policy.pick(candidates, chat(*history("boats", turns))) is b


def test_first_message_alone_does_not_decide() -> None:
    """Same first user message, different later turns: the later turns decide."""
    policy = CacheAwarePolicy("prefill")
    a, b = server("a"), server("b")
    first = [SYSTEM, ("user", "Plan a trip. " * 10)]
    policy.on_dispatch(a, chat(*first, ("assistant", "Paris? " * 40)))
    policy.on_dispatch(b, chat(*first, ("assistant", "Tokyo! " * 40)))
    follow_up = ("user", "And then?")
    assert policy.pick([a, b], chat(*first, ("assistant", "Tokyo! " * 40), follow_up)) is b
    assert policy.pick([a, b], chat(*first, ("assistant", "Paris? " * 40), follow_up)) is a


SEEN = list(range(1000))


@pytest.mark.parametrize(
    ("a_load", "b_load", "query", "expected"),
    [
        pytest.param({}, {}, SEEN + [5, 6], "a", id="match_above_threshold_follows_cache"),
        pytest.param({"in_flight": 3}, {}, SEEN + [5, 6], "a",
                     id="moderate_load_does_not_override_cache"),
        pytest.param({"in_flight": 60}, {"in_flight": 2}, SEEN + [5, 6], "b",
                     id="imbalance_guard_sends_to_least_loaded"),
        pytest.param({"in_flight": 50}, {"in_flight": 40}, SEEN + [5, 6], "a",
                     id="large_but_relatively_small_gap_keeps_cache"),
        pytest.param({"in_flight": 3}, {"in_flight": 1}, SEEN[:200] + list(range(5000, 6000)),
                     "b", id="below_threshold_least_loaded"),
        pytest.param({"load": {"running": 80}, "age": 1.0}, {"age": 1.0}, SEEN, "b",
                     id="server_reported_queue_trips_the_guard"),
        pytest.param({"tokens": 40_000}, {}, SEEN, "b", id="queued_prompt_tokens_trip_the_guard"),
    ],
)
def test_cache_or_load(a_load, b_load, query, expected) -> None:
    policy = CacheAwarePolicy("prefill")
    a, b = server("a", **a_load), server("b", **b_load)
    policy.on_dispatch(a, generate_ids(SEEN))
    assert policy.pick([a, b], generate_ids(query)).url == expected


DOCUMENT = list(range(20_000, 36_000))  # 16K tokens: a miss is ~31 load units


@pytest.mark.parametrize(
    ("a_load", "expected"),
    [
        pytest.param({"in_flight": 34}, "a", id="queue_as_long_as_the_miss_keeps_the_cache"),
        pytest.param({"in_flight": 3, "tokens": 40_000}, "b",
                     id="queued_uncached_work_clearly_dearer_moves"),
    ],
)
def test_guard_weighs_the_uncached_work_where_it_would_go(a_load, expected) -> None:
    """The imbalance guard fires (a is busy, b idle) but compares costs: a request whose 16K
    prefix a holds waits there rather than recompute it on b for no gain."""
    policy = CacheAwarePolicy("prefill")
    a, b = server("a", **a_load), server("b")
    policy.on_dispatch(a, generate_ids(DOCUMENT))
    assert policy.pick([a, b], generate_ids(DOCUMENT + [1, 2, 3])).url == expected
    assert policy.stats()["decisions"]["balance"] == 1


def test_coincidental_overlap_counts_as_a_tie() -> None:
    """Both hold the 1000-token prefix; a's extra 10 tokens must not outweigh its load."""
    policy = CacheAwarePolicy("prefill")
    a, b = server("a", in_flight=4), server("b", in_flight=1)
    policy.on_dispatch(a, generate_ids(SEEN + list(range(7000, 7010)) + [1]))
    policy.on_dispatch(b, generate_ids(SEEN + [2]))
    assert policy.pick([a, b], generate_ids(SEEN + list(range(7000, 7010)) + [3])) is b


def test_threshold_option() -> None:
    query = SEEN[:200] + list(range(5000, 5800))  # a holds 20% of it
    strict = CacheAwarePolicy("prefill", CacheAwareOptions(match_threshold=0.3))
    loose = CacheAwarePolicy("prefill", CacheAwareOptions(match_threshold=0.1))
    for policy, expected in ((strict, "b"), (loose, "a")):
        a, b = server("a", in_flight=2), server("b")
        policy.on_dispatch(a, generate_ids(SEEN))
        assert policy.pick([a, b], generate_ids(query)).url == expected


def test_removed_worker_is_forgotten() -> None:
    policy = CacheAwarePolicy("prefill")
    a, b = server("a"), server("b")
    policy.on_dispatch(a, generate_ids(SEEN))
    policy.on_dispatch(b, generate_ids(SEEN[:10]))
    policy.on_servers_changed([b])
    assert policy.tree.server_sizes() == {"b": 40}  # 10 tokens, 4 size units each
    assert policy.stats()["tree_size"] == 40


def test_tree_bound_holds_across_dispatches() -> None:
    policy = CacheAwarePolicy("prefill", CacheAwareOptions(max_tree_size=5_000))
    servers = [server(f"w{i}") for i in range(4)]
    for i in range(200):
        view = generate_ids(list(range(i * 100, i * 100 + 300)))
        policy.on_dispatch(policy.pick(servers, view), view)
        assert policy.tree.size <= 5_000


def test_stats_count_decisions() -> None:
    policy = CacheAwarePolicy("prefill")
    a, b = server("a"), server("b")
    policy.pick([a, b], generate_ids(SEEN))
    policy.on_dispatch(a, generate_ids(SEEN))
    policy.pick([a, b], generate_ids(SEEN))
    assert policy.stats()["decisions"] == {"cache": 1, "capacity": 0, "spread": 0, "load": 1,
                                           "balance": 0, "placement": 0}


def test_fresh_long_prompts_are_placed_the_same_way_by_every_instance() -> None:
    """Two policies (two servers or replicas) that share no history place a new
    conversation on the same server, and its later turns follow it there."""
    servers = [server(f"http://10.0.0.{i}:30000") for i in range(1, 5)]
    system = "system: you are a careful assistant for the docs team. " * 8
    first, second = CacheAwarePolicy("prefill"), CacheAwarePolicy("prefill")
    for policy in (first, second):
        policy.on_servers_changed(servers)
    for n in range(20):
        turn1 = chat(("system", system), ("user", f"question {n}: how do I deploy?"))
        turn3 = chat(("system", system), ("user", f"question {n}: how do I deploy?"),
                     ("assistant", "like this"), ("user", "and then?"))
        here = first.pick(servers, turn1)
        assert second.pick(servers, turn1) is here
        assert second.pick(servers, turn3) is here  # no history in `second`: the ring
    assert first.stats()["decisions"]["placement"] == 20


def test_ring_placement_spills_over_when_its_server_is_loaded() -> None:
    servers = [server(f"http://10.0.0.{i}:30000") for i in range(1, 4)]
    policy = CacheAwarePolicy("prefill", CacheAwareOptions(balance_abs_threshold=1e9))
    policy.on_servers_changed(servers)
    view = generate_ids(list(range(5000, 5400)))
    home = policy.pick(servers, view)
    home.in_flight = 40  # far over (1 + 0.25) x the average load
    assert policy.pick(servers, view) is not home


FLEET = [f"http://10.0.1.{i}:30000" for i in range(1, 5)]
HOT = list(range(40_000, 44_096))  # a hot 4K-token system prompt


def conversation(n: int) -> RequestView:
    return generate_ids(HOT + list(range(100_000 + n * 300, 100_300 + n * 300)))


def test_a_hot_prefix_spreads_to_a_copy_and_comes_back_as_load_drops() -> None:
    servers = [server(url) for url in FLEET]
    policy = CacheAwarePolicy("prefill")
    policy.on_servers_changed(servers)
    home = policy.pick(servers, conversation(0))
    policy.on_dispatch(home, conversation(0))
    assert policy.pick(servers, conversation(1)) is home  # idle: the cache wins
    home.in_flight, home.in_flight_tokens = 12, 3600  # its queue outweighs a 4K miss
    copy = policy.pick(servers, conversation(2))
    assert copy is not home and policy.stats()["decisions"]["spread"] == 1
    move = policy.stats()["last_move"]  # what moved it, for an operator asking why
    assert move["reason"] == "spread"
    seen = {t["url"]: t for t in move["targets"]}
    assert seen[home.url]["matched"] > 0 and seen[home.url]["load"] >= 12
    assert seen[copy.url]["matched"] == 0 and seen[copy.url]["cost"] < seen[home.url]["cost"]
    policy.on_dispatch(copy, conversation(2))
    assert policy.pick(servers, conversation(3)) is copy  # the copy takes the overflow
    home.in_flight, home.in_flight_tokens = 0, 0
    assert policy.pick(servers, conversation(4)) is home  # load dropped: back to the first


def test_instances_agree_on_which_holder_takes_a_new_conversation() -> None:
    """Two processes whose trees hold the prefix on every target, with different histories
    of ties, still send a new conversation to the same target (ring order, not turns)."""
    servers = [server(url) for url in FLEET]
    policies = [CacheAwarePolicy("prefill"), CacheAwarePolicy("prefill")]
    for policy in policies:
        policy.on_servers_changed(servers)
        for w in servers:
            policy.on_dispatch(w, conversation(0))
    policies[1].pick(servers, generate_ids(list(range(10))))  # a different turn count
    for n in range(1, 20):
        assert policies[0].pick(servers, conversation(n)) is policies[1].pick(
            servers, conversation(n))
