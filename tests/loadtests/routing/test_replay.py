"""The offline DP chat replay (`loadtests/routing/replay.py`): a seed whose conversations pile
onto one rank when the policy does not know the ranks' caches (43 of 64 requests on one
4,096-token rank, 0.84x the one-rank hit rate) spreads once it does, and keeps most of the
one-rank hit rate."""

from __future__ import annotations

import pytest

from loadtests.routing.replay import compare, compare_workers


def test_knowing_the_cache_size_spreads_a_hot_prompt_over_the_ranks() -> None:
    blind = compare("cache_aware", seed=7, servers=2, ranks=4, cache_tokens=16384, told=False)
    told = compare("cache_aware", seed=7, servers=2, ranks=4, cache_tokens=16384)
    # one rank: the cache holds it all, whether the policy knows its size or not
    assert blind["hit_1_rank"] == pytest.approx(told["hit_1_rank"], abs=0.02)
    assert min(blind["hit_1_rank"], told["hit_1_rank"]) > 0.8
    assert max(blind["per_rank"]) > 0.6 * sum(blind["per_rank"])
    assert max(told["per_rank"]) < 0.4 * sum(told["per_rank"])
    assert told["ratio"] > 0.9 and told["ratio"] > blind["ratio"] + 0.1


def test_worker_processes_sharing_the_prefix_table_keep_the_hit_rate() -> None:
    """Four policy instances, a random one per turn (as `--workers 4`): without the shared
    prefix table a later turn often reaches a process that never saw its conversation."""
    alone = compare_workers("cache_aware", seed=0, servers=4, ranks=1, cache_tokens=16384,
                            workers=4, shared=False)
    shared = compare_workers("cache_aware", seed=0, servers=4, ranks=1, cache_tokens=16384,
                             workers=4)
    assert alone["hit_1"] == shared["hit_1"] > 0.8  # the same one-process run
    assert alone["gap_points"] > 5
    assert shared["gap_points"] < 2.5
