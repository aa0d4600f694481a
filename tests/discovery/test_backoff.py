"""Capped exponential backoff with jitter."""

from __future__ import annotations

import pytest

from gateway.discovery.backoff import Backoff


@pytest.mark.parametrize("rng_value, expected", [
    (0.0, [0.5, 1.0, 2.0, 2.0]),
    (1.0, [1.0, 2.0, 4.0, 4.0]),
], ids=["lowest-jitter", "highest-jitter"])
def test_doubles_up_to_the_cap(rng_value, expected):
    backoff = Backoff(1.0, 4.0, rng=lambda: rng_value)
    assert [backoff.next() for _ in expected] == expected


def test_reset_starts_over():
    backoff = Backoff(1.0, 8.0, rng=lambda: 1.0)
    backoff.next()
    backoff.next()
    backoff.reset()
    assert backoff.next() == 1.0


def test_jitter_spreads_delays():
    delays = {round(Backoff(1.0, 1.0).next(), 6) for _ in range(50)}
    assert len(delays) > 10 and all(0.5 <= d <= 1.0 for d in delays)


def test_bad_bounds():
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)
