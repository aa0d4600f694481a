"""The shared load score: server correction only on a consistent basis, rotation, the guard."""

from __future__ import annotations

import time

import pytest

from gateway.policies import create_policy
from gateway.scheduling.load import (
    LoadOptions,
    all_fresh,
    cheapest,
    imbalanced,
    load_scores,
    rotating_argmin,
    spread,
    with_uncached,
)
from tests.unit.builders import generate_text, server

OPTS = LoadOptions(token_unit=100, usage_weight=10.0, load_max_age=5.0)


@pytest.mark.parametrize(
    ("servers", "expected"),
    [
        pytest.param([server("a", in_flight=2, tokens=300)], [5.0], id="gateway_only_requests_plus_tokens"),
        pytest.param(
            [server("a", in_flight=1, tokens=100,
                    load={"running": 3, "waiting": 2, "waiting_uncached_tokens": 50,
                          "token_usage": 0.5}, age=1.0)],
            [5 + 1 + 5.0], id="fresh_takes_larger_of_gateway_and_server",
        ),
        pytest.param(
            [server("a", in_flight=1, load={"running": 9}, age=60.0)],
            [1.0], id="stale_snapshot_ignored",
        ),
        pytest.param(
            [server("a", in_flight=1, load={"running": 9}, age=1.0),
             server("b", in_flight=2)],
            [1.0, 2.0], id="one_without_figures_puts_all_on_gateway_counters",
        ),
        pytest.param(
            [server("a", in_flight=4, load={"running": 1}, age=1.0),
             server("b", in_flight=0, load={"running": 7}, age=1.0)],
            [4.0, 7.0], id="server_sees_traffic_from_elsewhere",
        ),
    ],
)
def test_load_scores(servers, expected) -> None:
    assert load_scores(servers, OPTS, time.monotonic()) == pytest.approx(expected)


def test_never_polled_is_not_fresh() -> None:
    assert not all_fresh([server("a")], time.monotonic(), 5.0)


@pytest.mark.parametrize(
    ("values", "start", "expected"),
    [
        pytest.param([3, 1, 2], 0, 1, id="plain_minimum"),
        pytest.param([1, 1, 1], 0, 0, id="tie_from_start_0"),
        pytest.param([1, 1, 1], 2, 2, id="tie_from_start_2"),
        pytest.param([1, 2, 1], 5, 2, id="start_wraps_around"),
    ],
)
def test_rotating_argmin(values, start, expected) -> None:
    assert rotating_argmin(values, start) == expected


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        pytest.param([0, 40], True, id="idle_vs_busy"),
        pytest.param([30, 40], False, id="relative_gap_too_small"),
        pytest.param([100, 125], False, id="absolute_gap_too_small"),
        pytest.param([100, 200], True, id="both_gaps_exceeded"),
        pytest.param([5], False, id="single_worker"),
    ],
)
def test_imbalanced(scores, expected) -> None:
    assert imbalanced(scores, 32, 1.5) is expected


@pytest.mark.parametrize(
    ("lengths", "key_len", "expected"),
    [
        pytest.param([1000, 0], 1000, [2.0, 12.0], id="a_full_hit_adds_nothing"),
        pytest.param([500, 250], 1000, [7.0, 9.5], id="the_uncached_part_is_added"),
        pytest.param([0, 0], 0, [12.0, 12.0], id="no_key_the_whole_prompt"),
    ],
)
def test_with_uncached(lengths, key_len, expected) -> None:
    assert with_uncached([2.0, 2.0], lengths, key_len, 1000, 100) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("costs", "lengths", "expected"),
    [
        pytest.param([34.0, 32.0], [16000, 0], 0, id="a_miss_elsewhere_as_dear_keeps_the_cache"),
        pytest.param([60.0, 32.0], [16000, 0], 1, id="a_clearly_cheaper_miss_moves"),
        pytest.param([40.0, 2.0, 2.5], [100, 0, 50], 2, id="of_the_cheap_ones_the_longest_match"),
        pytest.param([3.0, 3.0], [0, 0], 1, id="ties_rotate"),
    ],
)
def test_cheapest(costs, lengths, expected) -> None:
    assert cheapest(costs, lengths, 1.2, 1) == expected


@pytest.mark.parametrize(
    ("costs", "fresh", "expected"),
    [
        pytest.param([20.0, 5.0, 5.0], [False, True, True], 1, id="cheapest_fresh_first_on_ring"),
        pytest.param([20.0, 9.0, 5.0], [False, True, True], 2, id="the_lowest_cost_wins"),
        pytest.param([6.0, 5.0, 5.0], [False, True, True], None, id="not_clearly_lower_stays"),
        pytest.param([20.0, 1.0, 18.0], [False, False, True], None,
                     id="a_holder_left_out_is_no_new_copy"),
    ],
)
def test_spread(costs, fresh, expected) -> None:
    assert spread([0, 1, 2], costs, fresh, 0, 1.2) == expected


def test_a_snapshot_forgets_our_requests_that_ended_after_it() -> None:
    """A poll taken while our request ran still counts it (running, and its KV in
    token_usage) after it ended; the requests dispatched before the snapshot that have
    finished since are taken off it, those dispatched after it are not in it to begin with."""
    busy = {"running": 1, "token_usage": 0.2, "max_total_tokens": 2048}
    w = server("a", load=busy, age=1.0)
    assert load_scores([w], OPTS, time.monotonic()) == [pytest.approx(1 + 0.2 * 10)]
    w.load.settle(time.monotonic(), 409)  # dispatched after the snapshot: not in it
    assert load_scores([w], OPTS, time.monotonic()) == [pytest.approx(1 + 0.2 * 10)]
    w.load.settle(w.load.updated_at - 0.5, 409)  # running when it was taken
    assert load_scores([w], OPTS, time.monotonic()) == [pytest.approx((0.2 - 409 / 2048) * 10)]
    w.load.settle(w.load.updated_at - 0.5, 409)  # never below nothing
    assert load_scores([w], OPTS, time.monotonic()) == [0.0]


def test_a_conversation_stays_on_its_server_when_the_snapshot_shows_its_last_turn() -> None:
    """The e2e failure this fixes (tests/e2e_sglang/test_dp.py, 2026-12-01): turn 5 went to
    the other rank because the holder's snapshot, taken during turn 4, still showed turn 4
    running with its KV in use, and `spread` found the idle target clearly cheaper."""
    policy = create_policy("cache_aware", "prefill")
    text = "system: be brief\n" + "user: tell me about harbours\nassistant: ok\n" * 30
    for settled in (False, True):
        holder = server("http://h:1", load={"running": 1, "token_usage": 0.3,
                                            "max_total_tokens": 2048}, age=1.0)
        idle = server("http://i:1", load={"max_total_tokens": 2048}, age=1.0)
        policy.on_servers_changed([holder, idle])
        policy.on_dispatch(holder, generate_text(text))  # the previous turn went there
        if settled:
            holder.load.settle(holder.load.updated_at - 0.5, 600)
        chosen = policy.pick([holder, idle], generate_text(text + "user: and ships?\n"))
        assert (chosen is holder) is settled
