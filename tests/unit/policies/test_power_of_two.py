"""power_of_two: two random candidates, the less loaded wins, both judged on one basis."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.policies.power_of_two import PowerOfTwoPolicy
from tests.unit.builders import chat, server

VIEW = chat(("user", "hello"))


def policy(seed: int = 7) -> PowerOfTwoPolicy:
    p = PowerOfTwoPolicy("prefill")
    p.rng = random.Random(seed)
    return p


@pytest.mark.parametrize(
    ("pair", "expected"),
    [
        pytest.param([server("a", tokens=5000), server("b", tokens=10)], "b",
                     id="fewer_in_flight_tokens"),
        pytest.param([server("a", in_flight=4), server("b", in_flight=1)], "b",
                     id="fewer_in_flight_requests"),
        pytest.param(
            [server("a", load={"running": 2, "waiting": 40}, age=1.0),
             server("b", in_flight=3, age=1.0)],
            "b", id="fresh_server_queue_corrects_gateway_view",
        ),
        # The sglang-router lesson: one candidate without figures must not be compared on
        # gateway counters against the other's server figures.
        pytest.param(
            [server("a", load={"running": 2, "waiting": 40}, age=1.0),
             server("b", in_flight=3)],
            "a", id="one_lacks_figures_both_compared_on_gateway_counters",
        ),
    ],
)
def test_less_loaded_of_the_two(pair, expected) -> None:
    for seed in range(5):  # whatever order the two are sampled in
        assert policy(seed).pick(pair, VIEW).url == expected


def test_single_candidate() -> None:
    only = server("a", in_flight=100)
    assert policy().pick([only], VIEW) is only


def test_most_loaded_never_wins_and_the_rest_share() -> None:
    servers = [server("hot", in_flight=50)] + [server(f"w{i}", in_flight=i) for i in range(3)]
    p = policy()
    picks = Counter(p.pick(servers, VIEW).url for _ in range(6000))
    assert "hot" not in picks
    # w0 wins every pair it is in (1/2 of pairs), w1 the pairs without w0 (1/3), w2 only vs hot.
    assert picks["w0"] / 6000 == pytest.approx(1 / 2, abs=0.03)
    assert picks["w1"] / 6000 == pytest.approx(1 / 3, abs=0.03)
    assert picks["w2"] / 6000 == pytest.approx(1 / 6, abs=0.03)
