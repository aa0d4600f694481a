"""The stream-gap ring of gateway/health/deadlines.py as the relay feeds it: every gap until the
server has `min_samples`, then one in four (`_Ring.skip`, counted down by the caller), and
the learned gap deadline follows what was kept."""

from __future__ import annotations

import pytest

from gateway.health.deadlines import DeadlineOptions, LatencyModel


def feed(model: LatencyModel, url: str, gaps: list[float]) -> None:
    """What gateway/dispatch/relay.py does after each chunk."""
    ring = model.gaps_of(url)
    for seconds in gaps:
        if ring.skip:
            ring.skip -= 1
        else:
            model.gap(ring, seconds)


def test_every_gap_is_kept_until_min_samples_then_one_in_four() -> None:
    model = LatencyModel(DeadlineOptions(min_samples=8))
    feed(model, "http://d:1", [0.01] * 8)
    ring = model.gaps_of("http://d:1")
    assert ring.count == 8
    feed(model, "http://d:1", [0.01] * 40)
    assert ring.count == 8 + 10  # one kept, three passed over, ten times


def test_the_ring_is_the_servers_own_and_lasts_across_streams() -> None:
    model = LatencyModel(DeadlineOptions(min_samples=8))
    feed(model, "http://d:1", [0.01] * 4)
    feed(model, "http://d:1", [0.01] * 4)  # a second stream of the same server
    feed(model, "http://d:2", [0.01] * 3)
    assert model.gaps_of("http://d:1").count == 8
    assert model.gaps_of("http://d:2").count == 3


def test_the_deadline_follows_the_kept_gaps() -> None:
    """Cold until min_samples; then factor x the percentile of the kept gaps (bounded by the
    floor and the limit); a slower server's sampled gaps raise its deadline."""
    options = DeadlineOptions(min_samples=8, floor=0.5, factor=4.0, percentile=0.99)
    model = LatencyModel(options)
    assert model.gap_deadline("http://d:1", 60.0) == options.gap_cold
    feed(model, "http://d:1", [0.2] * 8)
    assert model.gap_deadline("http://d:1", 60.0) == pytest.approx(0.8)
    feed(model, "http://d:1", [2.0] * 200)  # 50 of them kept: the percentile moves
    assert model.gap_deadline("http://d:1", 60.0) == pytest.approx(8.0)
    assert model.gap_deadline("http://d:1", 5.0) == 5.0  # the hard limit wins


def test_answer_deadline_is_the_learned_gap_per_asked_token_or_the_limit():
    model = LatencyModel(DeadlineOptions(factor=4.0, floor=1.0, min_samples=8))
    url = "http://d:1"
    assert model.answer_deadline(url, 100, 600.0) == 600.0  # nothing learned: not a hang
    for _ in range(10):
        model.gap(model.gaps_of(url), 0.02)
    assert model.answer_deadline(url, None, 600.0) == 600.0  # no budget asked
    assert model.answer_deadline(url, 99, 600.0) == pytest.approx(4.0 * 0.02 * 100)
    assert model.answer_deadline(url, 1, 600.0) == 1.0  # floored
    assert model.answer_deadline(url, 100_000, 600.0) == 600.0  # capped
