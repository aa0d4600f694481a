"""The status page's latency points, from snapshots of the gateway's own histograms."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.observability.latency_history import LatencyHistory, quantile, window_point

BOUNDS = [0.01, 0.1, 1.0, float("inf")]


@pytest.mark.parametrize("q, counts, expected", [
    (0.5, [0, 10, 10, 10], 0.055),  # all in (0.01, 0.1]: the middle of it
    (0.99, [0, 10, 10, 10], 0.0991),
    (0.5, [10, 10, 20, 20], 0.01),  # rank 10 is the top of the first bucket
    (0.9, [0, 0, 0, 5], 1.0),  # beyond the last finite bound: that bound
    (0.5, [0, 0, 0, 0], None),  # no samples
], ids=["middle", "p99", "bucket-edge", "overflow", "empty"])
def test_quantile_interpolates_like_histogram_quantile(q, counts, expected):
    got = quantile(q, BOUNDS, counts)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_a_window_is_the_difference_of_two_snapshots():
    before = ((0.01, 5.0), (0.1, 5.0), (1.0, 5.0), (float("inf"), 5.0))
    after = ((0.01, 5.0), (0.1, 15.0), (1.0, 15.0), (float("inf"), 15.0))
    point = window_point(100.0, before, after)
    assert point["count"] == 10 and point["p50"] == pytest.approx(0.055)
    restarted = window_point(100.0, after, before)  # counters went back: no negative counts
    assert restarted["count"] == 0 and restarted["p99"] is None


def test_series_has_one_point_per_window_and_the_one_in_progress():
    registry = CollectorRegistry()
    ttft = Histogram("gateway_time_to_first_token_seconds", "t", ["endpoint", "stream"],
                     buckets=(0.01, 0.1, 1.0), registry=registry)
    itl = Histogram("gateway_inter_token_latency_seconds", "i", ["endpoint"],
                    buckets=(0.01, 0.1, 1.0), registry=registry)
    history = LatencyHistory(registry.collect, window=10, span=3)
    history.snapshot(now=0)
    for _ in range(4):
        ttft.labels("chat", "true").observe(0.05)
    ttft.labels("generate", "false").observe(0.5)  # summed over the labels
    history.snapshot(now=10)
    for _ in range(3):
        itl.labels("chat").observe(0.005)
    out = history.series(registry.collect(), now=15)
    assert out["window"] == 10
    assert [(p["t"], p["count"]) for p in out["ttft"]] == [(10, 5), (15, 0)]
    assert 0.01 < out["ttft"][0]["p50"] <= 0.1 and out["ttft"][0]["p99"] > 0.1
    assert [(p["t"], p["count"]) for p in out["itl"]] == [(10, 0), (15, 3)]
    assert out["itl"][1]["p50"] == pytest.approx(0.005)
    for now in (20, 30, 40, 50):  # the ring keeps `span` windows
        history.snapshot(now=now)
    assert [p["t"] for p in history.series(registry.collect(), now=55)["ttft"]] == \
        [30, 40, 50, 55]
