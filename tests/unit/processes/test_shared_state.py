"""A server's in-flight figures across workers (`ServerShare`): each worker writes its own
column, reads the others' sums, and reuses a sum for at most `OTHERS_TTL`."""

from __future__ import annotations

import os
import time

import pytest

from gateway.processes import shared_state
from gateway.processes.shared_state import SharedState

URL = "http://127.0.0.1:30000"


@pytest.fixture
def block(tmp_path):
    """A gateway's block of 3 workers (each worker is its column: one process plays all)."""
    state = SharedState(f"pdgw-test-{os.getpid()}-{time.monotonic_ns()}", 3, 0,
                        str(tmp_path / "lock"), create=True)
    yield state
    state.close(unlink=True)


def test_each_worker_sees_the_others_sums_not_its_own(block):
    mine, theirs, third = block.share(URL, 0), block.share(URL, 1), block.share(URL, 2)
    mine.publish(5, 500)  # never in its own `others`
    theirs.publish(2, 200)
    third.publish(1, 10)
    assert mine.others() == (3, 210)
    assert theirs.others() == (6, 510)


def test_a_sum_is_reused_for_the_ttl_then_read_again(block, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(shared_state.time, "monotonic", lambda: now[0])
    mine, theirs = block.share(URL, 0), block.share(URL, 1)
    theirs.publish(1, 10)
    assert mine.others() == (1, 10)
    theirs.publish(4, 40)
    now[0] += shared_state.OTHERS_TTL / 2
    assert mine.others() == (1, 10)  # within the TTL: the sum already taken
    now[0] += shared_state.OTHERS_TTL
    assert mine.others() == (4, 40)


def test_servers_keep_their_own_slots(block):
    a, b = block.share(URL, 0), block.share("http://127.0.0.1:30001", 1)
    b.publish(7, 70)
    assert a.others() == (0, 0)
    assert block.share(URL, 1).others() == (0, 0)
    assert block.share("http://127.0.0.1:30001", 0).others() == (7, 70)


def test_an_exited_workers_figures_stop_counting_and_the_others_stay(block):
    """The supervisor forgets a dead worker: its slots, legs, waiter and connections."""
    other_url = "http://127.0.0.1:30001"
    dead, live = block.share(URL, 1), block.share(URL, 2)
    dead.publish(3, 300)
    block.share(other_url, 1).publish(2, 20)
    live.publish(1, 10)
    block.share(other_url, 2).publish(4, 40)
    assert block.try_admit(1, 3) and block.try_admit(1, 3) and block.try_admit(2, 3)
    assert not block.try_admit(0, 3)  # the limit of 3, two of them the dead worker's
    block.publish_waiting(1, 0, 5.0)  # its waiter: class 0 since t = 5 s
    block.publish_connections(1, 0)
    block.publish_connections(2, 7)
    assert block.waits_longer_elsewhere(0, 1, 6.0)
    assert block.fewest_connections_elsewhere(0) == 0

    block.forget_worker(1)

    assert block.share(URL, 0).others() == (1, 10)
    assert block.share(other_url, 0).others() == (4, 40)
    assert block.active() == 1 and block.try_admit(0, 3)
    assert not block.waits_longer_elsewhere(0, 1, 6.0)
    assert block.fewest_connections_elsewhere(0) == 7  # nobody leaves a connection to it
