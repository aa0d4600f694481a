"""min_ttft: queue-versus-cache trade-off for prefill, headroom for decode."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.policies.min_ttft import MinTtftOptions, MinTtftPolicy
from tests.unit.builders import generate_ids, server

PROMPT = list(range(1000))  # 1000 prompt tokens


def prefill(**options) -> MinTtftPolicy:
    return MinTtftPolicy("prefill", MinTtftOptions(**options))


@pytest.mark.parametrize(
    ("a_queued", "a_cached", "b_kwargs", "expected"),
    [
        pytest.param(0, 1000, {}, "a", id="cached_and_idle"),
        pytest.param(3000, 1000, {}, "b", id="long_queue_outweighs_full_cache"),
        pytest.param(600, 1000, {}, "a", id="short_queue_worth_waiting_for_cache"),
        pytest.param(0, 500, {"load": {"waiting_uncached_tokens": 3000}, "age": 1.0}, "a",
                     id="server_reported_queue_on_the_other"),
        pytest.param(0, 0, {"load": {"waiting_uncached_tokens": 3000}, "age": 1.0}, "a",
                     id="no_cache_anywhere_shorter_queue"),
    ],
)
def test_prefill_minimises_estimated_ttft(a_queued, a_cached, b_kwargs, expected) -> None:
    policy = prefill()
    a = server("a", age=1.0 if b_kwargs.get("age") else None)
    b = server("b", **b_kwargs)
    if a_cached:
        policy.on_dispatch(a, generate_ids(PROMPT[:a_cached]))
        policy.on_complete(a, policy._last[0], True)
    if a_queued:
        policy.on_dispatch(a, generate_ids(list(range(50_000, 50_000 + a_queued))))
    assert policy.pick([a, b], generate_ids(PROMPT)).url == expected


def test_stale_server_queue_is_ignored() -> None:
    policy = prefill()
    a, b = server("a", load={"waiting_uncached_tokens": 9000}, age=60.0), server("b")
    policy.on_dispatch(b, generate_ids(list(range(5000, 5500))))  # b: 500 queued
    assert policy.pick([a, b], generate_ids(PROMPT)) is a


def test_estimates_are_seconds_at_the_configured_throughput() -> None:
    policy = prefill(prefill_tokens_per_second=10_000.0)
    a, b = server("a"), server("b")
    policy.on_dispatch(a, generate_ids(PROMPT[:500]))
    estimates = policy.ttft_estimates([a, b], generate_ids(PROMPT), fresh=False)
    assert estimates == pytest.approx([(500 + 500) / 10_000, 1000 / 10_000])


def test_completion_releases_the_queue() -> None:
    policy = prefill()
    a, b = server("a"), server("b")
    first = generate_ids(PROMPT + list(range(5000, 5200)))
    policy.on_dispatch(a, first)
    assert policy.pick([a, b], generate_ids(PROMPT)) is b  # a still busy with 1200 tokens
    policy.on_complete(a, first, True)
    assert policy.pick([a, b], generate_ids(PROMPT)) is a  # a has it cached now
    assert policy.stats()["queued_uncached_tokens"] == {"a": 0}


def capacity(w, max_running: int) -> None:
    w.load.max_running_requests = max_running  # a /v1/loads field ServerLoad may lack


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        pytest.param(server("a", "decode", load={"token_usage": 0.8}, age=1.0),
                     server("b", "decode", load={"token_usage": 0.3}, age=1.0), "b",
                     id="lower_kv_usage"),
        pytest.param(server("a", "decode", load={"running": 90}, age=1.0),
                     server("b", "decode", load={"running": 10, "token_usage": 0.05}, age=1.0),
                     "b", id="fewer_running_of_max_running"),
        pytest.param(server("a", "decode", tokens=90_000,
                            load={"token_usage": 0.1, "max_total_tokens": 100_000}, age=1.0),
                     server("b", "decode", load={"token_usage": 0.5, "max_total_tokens": 100_000},
                            age=1.0),
                     "b", id="gateway_in_flight_tokens_correct_stale_usage"),
        pytest.param(server("a", "decode", in_flight=5, load={"token_usage": 0.0}, age=1.0),
                     server("b", "decode", in_flight=1, load={"token_usage": 0.9}),
                     "b", id="without_fresh_figures_gateway_counts_decide"),
    ],
)
def test_decode_prefers_headroom(a, b, expected) -> None:
    for w in (a, b):
        capacity(w, 100)
    assert MinTtftPolicy("decode").pick([a, b], generate_ids(PROMPT)).url == expected


def test_decode_ties_rotate() -> None:
    policy = MinTtftPolicy("decode")
    servers = [server(u, "decode") for u in "abc"]
    assert Counter(policy.pick(servers, generate_ids(PROMPT)).url for _ in range(9)) == {
        "a": 3, "b": 3, "c": 3}


def test_removed_worker_is_forgotten() -> None:
    policy = prefill()
    a, b = server("a"), server("b")
    policy.on_dispatch(a, generate_ids(PROMPT))
    policy.on_servers_changed([b])
    assert policy.stats() == {"tree_size": 0, "tree_nodes": 0, "queued_uncached_tokens": {}}


def test_short_common_prefix_does_not_pin_every_request_to_one_server() -> None:
    """The bug the routing benchmark found: chats that share only their first few tokens all
    went to the server that had seen those tokens, because it looked a hair cheaper."""
    policy = MinTtftPolicy("prefill")
    servers = [server("a"), server("b"), server("c")]
    seen = Counter()
    for i in range(30):
        view = generate_ids([1, 2, 3] + [100 + i] * 60)
        chosen = policy.pick(servers, view)
        policy.on_dispatch(chosen, view)
        policy.on_complete(chosen, view, True)
        seen[chosen.url] += 1
    assert set(seen) == {"a", "b", "c"}
    assert max(seen.values()) <= 15, seen


def test_long_shared_prefix_is_still_followed() -> None:
    policy = MinTtftPolicy("prefill")
    servers = [server("a"), server("b")]
    first = generate_ids(list(range(500)) + [7])
    policy.on_dispatch(servers[1], first)
    policy.on_complete(servers[1], first, True)
    assert policy.pick(servers, generate_ids(list(range(500)) + [8])).url == "b"


def _loads(tokens: int, busy_us: int, rank: int = 0) -> dict:
    return {"dp_rank": rank, "total_prefill_uncached_tokens": tokens,
            "total_prefill_busy_us": busy_us}


def test_prefill_speed_is_measured_from_the_servers_counters() -> None:
    w = server("a")
    assert w.load.prefill_speed == 0.0  # never polled: the configured speed applies
    w.apply_loads({"loads": [_loads(1000, 100_000)]})  # since its start: 1k tokens in 0.1 s
    assert w.load.prefill_speed == pytest.approx(10_000.0)
    w.apply_loads({"loads": [_loads(5_000, 300_000)]})  # then 4k tokens in 0.2 s busy
    # tokens and busy time smoothed apart: the longer step weighs by its time
    assert w.load.prefill_speed == pytest.approx(
        (0.7 * 1000 + 0.3 * 4_000) * 1e6 / (0.7 * 100_000 + 0.3 * 200_000))
    before = w.load.prefill_speed
    w.apply_loads({"loads": [_loads(5_000, 300_000)]})  # idle between polls: unchanged
    assert w.load.prefill_speed == before
    w.apply_loads({"loads": [_loads(10, 100)]})  # restarted: counters went back, speed kept
    assert w.load.prefill_speed == before


def test_the_counters_since_the_start_weigh_as_one_poll() -> None:
    """A gateway started next to a server that has served for hours first reads all its
    counters: that speed, weighed as one poll's, gives way to what the polls then see."""
    w = server("a")
    w.apply_loads({"loads": [_loads(50_000_000, 10_000_000_000)]})  # 5k tokens/s, 3 hours
    assert w.load.prefill_speed == pytest.approx(5_000.0)
    tokens, busy = 50_000_000, 10_000_000_000
    for _ in range(12):  # then 20k tokens/s: 10k tokens in 0.5 s busy per poll
        tokens, busy = tokens + 10_000, busy + 500_000
        w.apply_loads({"loads": [_loads(tokens, busy)]})
    assert w.load.prefill_speed == pytest.approx(20_000.0, rel=0.05)


def test_a_dp_server_speed_is_its_ranks_together() -> None:
    w = server("a")
    w.dp_size = 2
    from gateway.servers.pool import Rank  # noqa: PLC0415 - only this test builds ranks
    w.ranks = [Rank(w, 0), Rank(w, 1)]
    w.apply_loads({"loads": [_loads(0, 0, 0), _loads(0, 0, 1)]})
    w.apply_loads({"loads": [_loads(10_000, 1_000_000, 0), _loads(30_000, 1_000_000, 1)]})
    assert w.ranks[0].load.prefill_speed == pytest.approx(10_000.0)
    assert w.ranks[1].load.prefill_speed == pytest.approx(30_000.0)
    assert w.load.prefill_speed == pytest.approx(40_000.0)


def test_a_measured_faster_server_wins_an_even_race() -> None:
    policy = prefill(prefill_tokens_per_second=10_000.0)
    slow, fast = server("slow"), server("fast")
    for w, tokens in ((slow, 5_000), (fast, 40_000)):
        w.apply_loads({"loads": [_loads(0, 0)]})
        w.apply_loads({"loads": [_loads(tokens, 1_000_000)]})
    policy.on_dispatch(fast, generate_ids(list(range(70_000, 72_000))))  # 2k queued on fast
    estimates = policy.ttft_estimates([slow, fast], generate_ids(PROMPT), fresh=False)
    assert estimates == pytest.approx([1000 / 5_000, (2000 + 1000) / 40_000])
    assert policy.pick([slow, fast], generate_ids(PROMPT)) is fast
