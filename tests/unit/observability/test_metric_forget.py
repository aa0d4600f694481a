"""A server that leaves the pool takes its labelled series with it: pod churn at new addresses
grew /metrics (150 servers added and removed: 459 -> 609 series) and the flush loop for the
gateway's whole life (2026-12-07)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.observability.metrics import Metrics
from gateway.servers.pool import Server, ServerPool


def exposition(metrics: Metrics) -> str:
    metrics.flush()
    return generate_latest(metrics.registry).decode()


def test_a_removed_servers_series_go_and_the_others_stay():
    metrics = Metrics(CollectorRegistry(), ServerPool())
    gone = Server("http://10.0.0.7:30000", "prefill")
    kept = Server("http://10.0.0.8:30001", "decode")
    for server, role in ((gone, "prefill"), (kept, "decode")):
        metrics.child(server, metrics.decisions, role, "cache_aware").pending += 3
    metrics.child(gone, metrics.prompt_tokens).pending += 40
    metrics.child(gone, metrics.pair_failures, kept.url, url_first=True).pending += 1
    before = exposition(metrics)
    assert before.count(gone.url) >= 3 and kept.url in before
    buffered = len(metrics.buffer._children)

    metrics.forget(gone)

    after = exposition(metrics)
    assert gone.url not in after, [line for line in after.splitlines() if gone.url in line]
    assert f'server="{kept.url}"' in after
    assert len(metrics.buffer._children) == buffered - 3 and gone.metric_children == {}


def test_what_a_removed_server_counted_last_is_published_before_it_goes():
    """The buffered increments flush first: the series' last value is whole in a scrape taken
    just before the removal (nothing is lost between two flushes, only the series goes)."""
    metrics = Metrics(CollectorRegistry(), ServerPool())
    gone = Server("http://10.0.0.9:30000", "prefill")
    counter = metrics.child(gone, metrics.prompt_tokens)
    counter.pending += 7
    child = counter.child
    metrics.forget(gone)
    assert child._value.get() == 7
