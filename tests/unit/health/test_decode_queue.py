"""DecodeQueue: a request silent in its decode's queue is kept while the decode works through
it; a frozen, idle or stuck decode is cut within one window of its last answered poll."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.health.queue_wait import PROBE, DecodeQueue
from gateway.servers.load import ServerLoad
from gateway.servers.pool import Server

WINDOW = 5.0
T0 = 1000.0  # when the silence began (monotonic)


class Progress:
    """What the decode did for its other requests (their chunks, legs finished)."""

    def __init__(self) -> None:
        self.value = 0.0

    def __call__(self) -> float:
        return self.value


def decode(**load) -> Server:
    s = Server(url="http://d0", role="decode", verified=True, model="m")
    s.load = ServerLoad(**{"updated_at": T0 - 1, "waiting": 3, **load})
    return s


def poll(s: Server, at: float, **change) -> None:
    s.load = dataclasses.replace(s.load, updated_at=at, **change)


def test_a_decode_working_through_its_queue_keeps_the_request_look_after_look():
    d, progress = decode(), Progress()
    q = DecodeQueue(d, progress, hard=120.0)
    poll(d, T0 + 4)
    first = q.look(T0, T0 + WINDOW, WINDOW)
    assert first == T0 + WINDOW + PROBE * WINDOW  # a first look only notes the progress
    for step in range(1, 5):  # a poll every 2 s, its other streams moving
        now = first + (step - 1) * 2.0
        poll(d, now - 0.5)
        progress.value += 7
        later = q.look(T0, now, WINDOW)
        assert later == now - 0.5 + WINDOW  # one window after its last answered poll


@pytest.mark.parametrize("case", ["frozen", "stuck", "no-queue", "idle-pool-full-but-silent"])
def test_a_decode_that_shows_nothing_is_cut(case):
    d, progress = decode(), Progress()
    q = DecodeQueue(d, progress, hard=120.0)
    if case == "no-queue":  # nothing waits there: the request is not queued, it is lost
        poll(d, T0 + 4, waiting=0, token_usage=0.5)
        assert q.look(T0, T0 + WINDOW, WINDOW) is None
        return
    if case == "idle-pool-full-but-silent":
        poll(d, T0 + 4, waiting=0, token_usage=0.95)
    else:
        poll(d, T0 + 4)
    assert q.look(T0, T0 + WINDOW, WINDOW) is not None
    if case == "frozen":  # its polls hang: nothing answered since T0 + 4
        assert q.look(T0, T0 + 4 + WINDOW, WINDOW) is None
    else:  # it answers polls but serves nobody
        poll(d, T0 + WINDOW + 0.5)
        assert q.look(T0, T0 + WINDOW + PROBE * WINDOW, WINDOW) is None


def test_never_past_the_hard_limit_nor_without_loads():
    d, progress = decode(), Progress()
    q = DecodeQueue(d, progress, hard=8.0)
    poll(d, T0 + 4)
    assert q.look(T0, T0 + WINDOW, WINDOW) == T0 + WINDOW + PROBE * WINDOW
    poll(d, T0 + 6)
    progress.value = 1
    assert q.look(T0, T0 + WINDOW + PROBE * WINDOW, WINDOW) == T0 + 8.0  # capped by `hard`
    assert q.look(T0, T0 + 8.0, WINDOW) is None
    cold = DecodeQueue(decode(updated_at=0.0), Progress())  # loads polling off
    assert cold.look(T0, T0 + WINDOW, WINDOW) is None


def test_a_new_silence_starts_its_own_watch():
    d, progress = decode(), Progress()
    q = DecodeQueue(d, progress)
    poll(d, T0 + 4)
    q.look(T0, T0 + WINDOW, WINDOW)
    poll(d, T0 + 20)
    # a chunk came at T0 + 16: the stream's next silence is looked at as new, not as stuck
    assert q.look(T0 + 16, T0 + 16 + WINDOW, WINDOW) == T0 + 16 + WINDOW + PROBE * WINDOW


def test_the_clock_of_the_caller_is_converted():
    d, progress = decode(), Progress()
    q = DecodeQueue(d, progress)
    skew = 500.0  # the event loop's clock is 500 s behind time.monotonic()
    poll(d, T0 + 4)
    assert q.look(T0 - skew, T0 + WINDOW - skew, WINDOW, skew) == T0 + WINDOW + PROBE * WINDOW - skew
    poll(d, T0 + 5)
    progress.value = 1
    assert q.look(T0 - skew, T0 + WINDOW + PROBE * WINDOW - skew, WINDOW, skew) == T0 + 5 + WINDOW - skew
