"""QueueWatch: a queued attempt is kept while its servers move; a silent one is cut."""

from __future__ import annotations

import dataclasses
import time

import pytest

from gateway.health.queue_wait import QueueWatch, predicted_wait, shortest_wait
from gateway.servers.load import ServerLoad
from gateway.servers.pool import Server

WINDOW = 5.0
T0 = 1000.0  # monotonic time of the dispatch


def server(role: str, url: str, **load) -> Server:
    s = Server(url=url, role=role, verified=True, model="m")
    s.load = ServerLoad(**load)
    return s


def watch(ahead: int = 10_000, elsewhere: float = 0.0, counters: bool = True, at: float = T0):
    prefill = server("prefill", "http://p0", updated_at=at - 1, waiting_uncached_tokens=ahead,
                     prefill_tokens=50_000 if counters else 0, prefill_speed=2000.0)
    decode = server("decode", "http://d0", updated_at=at - 1)
    return QueueWatch(prefill, decode, 500, WINDOW, at, lambda: elsewhere), prefill, decode


def poll(s: Server, at: float, **change) -> None:
    """A /v1/loads answer asked at `at`."""
    s.load = dataclasses.replace(s.load, updated_at=at, **change)


@pytest.mark.parametrize("moved, decode_polled, kept", [
    (True, True, True),  # the prefill works through the queue ahead: queued, not hung
    (False, True, False),  # its count stood still for a window: a silent prefill
    (True, False, False),  # the decode answered no poll for a window: a silent decode
], ids=["busy-queue", "silent-prefill", "silent-decode"])
def test_a_look_while_queued(moved, decode_polled, kept):
    w, prefill, decode = watch()
    poll(prefill, T0 + 2, prefill_tokens=50_000 + (4000 if moved else 0))
    if decode_polled:
        poll(decode, T0 + 2)
    later = w.look(T0 + WINDOW)
    assert (later is not None) is kept
    if kept:
        assert later == T0 + 2 + WINDOW  # one window after the last sign of progress


@pytest.mark.parametrize("moved", [True, False], ids=["moving", "frozen-since-dispatch"])
def test_queued_now_needs_progress_seen_since_the_dispatch(moved):
    """What a suspected pair's cohort asks (rescue.pair_cohort): a queued attempt is left
    alone, one on a prefill that has shown nothing since its dispatch is not queued."""
    now = time.monotonic()
    w, prefill, decode = watch(at=now - 3)
    poll(prefill, now - 1, prefill_tokens=50_000 + (4000 if moved else 0))
    poll(decode, now - 1)
    w.look(now)
    assert w.queued() is moved


def test_past_its_mark_it_gets_one_window_from_its_turn():
    w, prefill, decode = watch(ahead=4000)
    poll(prefill, T0 + 2, prefill_tokens=54_000)  # the work ahead is done by T0 + 2
    poll(decode, T0 + 4)
    assert not w.queued() or w.look(T0 + WINDOW) is not None
    assert w.look(T0 + 2 + WINDOW + 0.1) is None  # its turn came and went: stuck


def test_past_its_mark_it_waits_as_long_as_elsewhere_would_take():
    w, prefill, decode = watch(ahead=4000, elsewhere=3 * WINDOW)
    poll(prefill, T0 + 2, prefill_tokens=54_000)
    for at in (T0 + 5, T0 + 9, T0 + 13):
        poll(prefill, at - 1, prefill_tokens=prefill.load.prefill_tokens + 100)
        poll(decode, at - 1)
        assert w.look(at) is not None
    poll(prefill, T0 + 17, prefill_tokens=prefill.load.prefill_tokens + 100)
    poll(decode, T0 + 17)
    # its turn: the snapshot of the first look that saw the mark passed (asked at T0 + 4)
    assert w.look(T0 + 18) is not None
    assert w.look(T0 + 4 + 3 * WINDOW + 0.1) is None


def test_without_counters_the_learned_deadline_cuts_as_before():
    w, prefill, decode = watch(counters=False)
    poll(prefill, T0 + 2)
    poll(decode, T0 + 2)
    assert not w.queued()
    assert w.look(T0 + WINDOW) is None


def test_predicted_wait_counts_the_larger_of_reported_and_own_work():
    s = server("prefill", "http://p1", updated_at=T0, waiting_uncached_tokens=2000,
               prefill_speed=1000.0)
    s.in_flight_tokens = 6000  # this gateway's, more than the server reported waiting
    assert predicted_wait(s, 1000) == pytest.approx(7.0)
    assert predicted_wait(server("prefill", "http://p2"), 1000) is None  # speed unknown


def test_shortest_wait_elsewhere_leaves_out_this_server_and_unusable_ones():
    here = server("prefill", "http://p0", updated_at=T0, prefill_speed=1000.0,
                  waiting_uncached_tokens=1000)
    busy = server("prefill", "http://p1", updated_at=T0, prefill_speed=1000.0,
                  waiting_uncached_tokens=9000)
    down = server("prefill", "http://p2", updated_at=T0, prefill_speed=1000.0)
    down.healthy = False
    assert shortest_wait([here, busy, down], here, 1000) == pytest.approx(10.0)


def test_work_ahead_that_never_gets_done_keeps_it_queued_only_until_its_predicted_turn():
    """10,000 tokens ahead at 2,000 tokens/s: due 2 x 5 s after dispatch. The prefill keeps
    moving, but never reaches the mark (what was ahead is stuck on a hung decode)."""
    w, prefill, decode = watch(ahead=10_000)
    for at in range(int(T0) + 4, int(T0) + 30, 4):
        poll(prefill, at, prefill_tokens=prefill.load.prefill_tokens + 100)
        poll(decode, at)
        later = w.look(at + 0.5)
        if at + 0.5 >= T0 + 10 + WINDOW:  # due, plus one window from its predicted turn
            assert later is None, at
            break
        assert later is not None, at
    else:
        pytest.fail("never cut")


def test_before_its_speed_is_measured_the_mark_alone_decides():
    w, prefill, decode = watch(ahead=10_000)
    w.due = float("inf")  # as built when the prefill's speed is not measured yet
    for at in range(int(T0) + 4, int(T0) + 40, 4):
        poll(prefill, at, prefill_tokens=prefill.load.prefill_tokens + 100)
        poll(decode, at)
        assert w.look(at + 0.5) is not None, at


def test_the_predicted_turn_is_not_bounded_before_the_speed_is_known():
    prefill = server("prefill", "http://p0", updated_at=T0 - 1, waiting_uncached_tokens=4000,
                     prefill_tokens=50_000)
    decode = server("decode", "http://d0", updated_at=T0 - 1)
    assert QueueWatch(prefill, decode, 500, WINDOW, T0, lambda: 0.0).due == float("inf")
    prefill.load.prefill_speed = 1000.0
    assert QueueWatch(prefill, decode, 500, WINDOW, T0, lambda: 0.0).due == T0 + 8.0
