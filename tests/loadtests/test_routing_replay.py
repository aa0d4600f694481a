"""The offline DP chat replay (`loadtests/routing_replay.py`): a seed whose conversations pile
onto one rank when the policy does not know the ranks' caches (54 of 64 requests on one
4,096-token rank, 0.67x the one-rank hit rate) spreads once it does, and keeps most of the
one-rank hit rate."""

from __future__ import annotations

from loadtests.routing_replay import compare


def test_knowing_the_cache_size_spreads_a_hot_prompt_over_the_ranks() -> None:
    blind = compare("cache_aware", seed=7, servers=2, ranks=4, cache_tokens=16384, told=False)
    told = compare("cache_aware", seed=7, servers=2, ranks=4, cache_tokens=16384)
    assert blind["hit_1_rank"] == told["hit_1_rank"] > 0.8  # one rank: the cache holds it all
    assert max(blind["per_rank"]) > 0.6 * sum(blind["per_rank"])
    assert max(told["per_rank"]) < 0.4 * sum(told["per_rank"])
    assert told["ratio"] > 0.9 and told["ratio"] > blind["ratio"] + 0.15
