"""Buffered metrics publish exactly what direct updates would (gateway/observability/metric_buffer.py)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.observability.metric_buffer import MetricBuffer
from gateway.observability.metrics import ITL_BUCKETS, LATENCY_BUCKETS


def _pair(buckets):
    direct, buffered = CollectorRegistry(), CollectorRegistry()
    return (Histogram("h", "h", ["e"], buckets=buckets, registry=direct).labels("x"),
            Histogram("h", "h", ["e"], buckets=buckets, registry=buffered).labels("x"),
            direct, buffered)


def test_a_flushed_histogram_reads_as_if_every_value_was_observed():
    rng = random.Random(3)
    for buckets in (LATENCY_BUCKETS, ITL_BUCKETS):
        direct, target, direct_registry, buffered_registry = _pair(buckets)
        buffer = MetricBuffer()
        buffered = buffer.histogram(target)
        values = [rng.choice([0.0, *buckets[:3]]) for _ in range(50)]  # bounds exactly
        values += [rng.expovariate(2.0) for _ in range(500)] + [1e9]  # and beyond the last
        for i, value in enumerate(values):
            direct.observe(value)
            buffered.observe(value)
            if i % 97 == 0:
                buffer.flush()
        buffer.flush()
        buffer.flush()  # nothing new: no change
        assert _samples(buffered_registry) == _samples(direct_registry)


def _samples(registry) -> dict:
    """Every sample but the creation time; sums rounded (added in another order)."""
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            value = round(sample.value, 6) if sample.name.endswith("_sum") else sample.value
            out[sample.name, tuple(sorted(sample.labels.items()))] = value
    return out


def test_a_counter_publishes_only_on_flush():
    registry = CollectorRegistry()
    counter = Counter("c", "c", ["e"], registry=registry).labels("x")
    buffered = MetricBuffer().counter(counter)
    buffered.inc()
    buffered.inc(2.5)
    assert registry.get_sample_value("c_total", {"e": "x"}) == 0.0
    buffered.flush()
    assert registry.get_sample_value("c_total", {"e": "x"}) == 3.5
    buffered.flush()
    assert registry.get_sample_value("c_total", {"e": "x"}) == 3.5
