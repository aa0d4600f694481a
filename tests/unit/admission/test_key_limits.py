"""The per-key prompt-token bucket: charges x n samples, and gives back what was never sent."""

from __future__ import annotations

import time

import pytest

from gateway.admission.key_limits import KeyLimits
from gateway.errors import TooManyRequests
from gateway.processes.shared_state import SharedState


def test_a_refused_request_gives_its_tokens_back():
    """A charge refunded (the request was refused before any server was asked) is there for
    the key's next request: before, it stayed spent for up to a minute."""
    now = [100.0]
    limits = KeyLimits(2, tokens_per_minute=600.0, clock=lambda: now[0])
    charged = limits.take_tokens(0, 400)
    assert charged == 400
    with pytest.raises(TooManyRequests):
        limits.take_tokens(0, 400)  # 200 left
    limits.give_back(0, charged)
    assert limits.take_tokens(0, 400) == 400  # the refund is there at once


def test_a_refund_never_fills_the_bucket_past_a_minute():
    now = [100.0]
    limits = KeyLimits(1, tokens_per_minute=600.0, clock=lambda: now[0])
    charged = limits.take_tokens(0, 300)
    now[0] += 60.0  # refilled meanwhile: full again
    limits.give_back(0, charged)
    limits.take_tokens(0, 600)
    with pytest.raises(TooManyRequests):
        limits.take_tokens(0, 1)  # the refund minted nothing past the minute's 600


def test_no_limit_or_no_key_charges_nothing_and_gives_nothing_back():
    limits = KeyLimits(1)
    assert limits.take_tokens(0, 10**6) == 0
    limits.give_back(0, 0)
    limited = KeyLimits(1, tokens_per_minute=600.0)
    assert limited.take_tokens(None, 10**6) == 0
    limited.give_back(None, 0)


def test_n_samples_are_charged_n_times():
    """SGLang prefills every sample: a 401-token prompt with n = 20 was charged 401."""
    now = [100.0]
    limits = KeyLimits(1, tokens_per_minute=600.0, clock=lambda: now[0])
    assert limits.take_tokens(0, 100, 5) == 500
    with pytest.raises(TooManyRequests):
        limits.take_tokens(0, 100, 2)  # 100 left
    with pytest.raises(TooManyRequests) as info:
        limits.take_tokens(0, 401, 20)  # 8,020 can never fit a minute of 600
    assert "x 20 samples" in info.value.message
    assert "retry-after" not in (info.value.headers or {})


def test_a_refund_reaches_the_bucket_shared_by_the_workers(tmp_path):
    """With --workers the buckets are in shared memory: a refund in one worker is seen by
    another."""
    name = f"pdgw-test-{time.monotonic_ns()}"
    lock = str(tmp_path / "lock")
    mine = SharedState(name, 2, 1, lock, create=True)
    theirs = SharedState(name, 2, 1, lock)
    try:
        now = [100.0]
        a = KeyLimits(1, tokens_per_minute=600.0, shared=mine, clock=lambda: now[0])
        b = KeyLimits(1, tokens_per_minute=600.0, shared=theirs, clock=lambda: now[0])
        charged = a.take_tokens(0, 500)
        with pytest.raises(TooManyRequests):
            b.take_tokens(0, 500)
        a.give_back(0, charged)
        b.take_tokens(0, 500)
    finally:
        theirs.close()
        mine.close(unlink=True)
