"""least_load: the lowest load score wins; ties rotate instead of piling on the first worker."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.policies.least_load import LeastLoadOptions, LeastLoadPolicy
from tests.unit.builders import chat, server

VIEW = chat(("user", "hello"))


@pytest.mark.parametrize(
    ("servers", "expected"),
    [
        pytest.param([server("a", in_flight=3), server("b", in_flight=1)], "b",
                     id="fewer_requests"),
        pytest.param([server("a", in_flight=1, tokens=8000), server("b", in_flight=2, tokens=100)],
                     "b", id="prompt_tokens_count"),
        pytest.param(
            [server("a", load={"running": 20}, age=1.0), server("b", in_flight=2, age=1.0)],
            "b", id="server_reported_queue_counts_when_fresh",
        ),
        pytest.param(
            [server("a", in_flight=1, load={"running": 20}, age=30.0), server("b", in_flight=2)],
            "a", id="stale_server_figures_ignored",
        ),
        pytest.param(
            [server("a", load={"running": 20}, age=1.0), server("b", in_flight=2)],
            "a", id="mixed_freshness_compares_gateway_counters",
        ),
        pytest.param(
            [server("a", load={"token_usage": 0.9}, age=1.0),
             server("b", load={"token_usage": 0.1}, age=1.0)],
            "b", id="kv_usage_counts",
        ),
        pytest.param(
            [server("a", load={"waiting_uncached_tokens": 20000}, age=1.0),
             server("b", load={"running": 4}, age=1.0)],
            "b", id="queued_uncached_tokens_count",
        ),
    ],
)
def test_picks_least_loaded(servers, expected) -> None:
    assert LeastLoadPolicy("prefill").pick(servers, VIEW).url == expected


def test_ties_rotate() -> None:
    policy = LeastLoadPolicy("decode", LeastLoadOptions())
    servers = [server(u) for u in "abc"]
    picks = Counter(policy.pick(servers, VIEW).url for _ in range(30))
    assert picks == {"a": 10, "b": 10, "c": 10}


def test_ties_rotate_only_among_the_least_loaded() -> None:
    policy = LeastLoadPolicy("decode")
    servers = [server("a"), server("busy", in_flight=5), server("c")]
    picks = Counter(policy.pick(servers, VIEW).url for _ in range(30))
    assert set(picks) == {"a", "c"} and abs(picks["a"] - picks["c"]) <= 10
