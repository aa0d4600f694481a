"""Session affinity: stable while usable and not overloaded, the same across processes without
shared state, bounded memory (LRU cap and TTL)."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.policies.cache_aware import CacheAwareOptions
from gateway.scheduling.affinity import SessionAffinity, overloaded
from gateway.scheduling.load import imbalanced
from gateway.servers.pool import Server

URLS = [f"http://10.0.0.{i}:30000" for i in range(1, 5)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_servers() -> list[Server]:
    return [Server(url, "prefill") for url in URLS]


def affinity(servers, capacity=1000, ttl=60.0, clock=None) -> SessionAffinity:
    a = SessionAffinity(capacity, ttl, clock=clock or Clock())
    a.on_servers_changed(servers)
    return a


def test_a_session_keeps_its_server():
    servers = make_servers()
    a = affinity(servers)
    first = a.pick(b"conv-1", servers)
    for _ in range(20):
        first.in_flight += 1  # its own turns load it a little: not an overload
        assert a.pick(b"conv-1", servers) is first
    assert a.counts == {"kept": 20, "placed": 1, "moved": 0}


def test_processes_that_share_nothing_place_sessions_alike():
    """Two servers (or replicas): separate memories, same servers, same choices."""
    mine, theirs = make_servers(), make_servers()
    a, b = affinity(mine), affinity(theirs)
    for n in range(200):
        session = f"session-{n}".encode()
        assert a.pick(session, mine).url == b.pick(session, theirs).url


def test_new_sessions_spread_over_the_servers():
    servers = make_servers()
    a = affinity(servers)
    spread = Counter(a.pick(f"s{n}".encode(), servers).url for n in range(2000))
    assert len(spread) == 4 and min(spread.values()) > 2000 / 4 * 0.6, spread


def test_an_unusable_server_moves_its_sessions_and_they_stay_moved():
    servers = make_servers()
    a = affinity(servers)
    home = a.pick(b"conv", servers)
    others = [w for w in servers if w is not home]
    moved = a.pick(b"conv", others)  # its server is down, draining or circuit-open
    assert moved is not home and a.counts["moved"] == 1
    assert a.pick(b"conv", servers) is moved  # back up: the conversation stays where it is


@pytest.mark.parametrize("load, kept", [
    (20, True),  # 20 more than the others: under the 32-unit guard
    (40, False),  # 40 more and over 1.5x: overloaded
], ids=["busy-but-not-overloaded", "overloaded"])
def test_an_overloaded_server_loses_the_session_a_busy_one_keeps_it(load, kept):
    servers = make_servers()
    a = affinity(servers)
    home = a.pick(b"conv", servers)
    for w in servers:
        w.in_flight = 4
    home.in_flight = 4 + load
    assert (a.pick(b"conv", servers) is home) is kept
    assert a.counts["moved"] == (0 if kept else 1)


@pytest.mark.parametrize("scores", [[0, 40], [10, 41], [10, 43], [30, 20, 90], [5, 5]])
def test_overloaded_is_cache_aware_s_balance_guard(scores):
    """One guard, one set of thresholds: a remembered server is overloaded exactly when
    cache_aware would call it and the least loaded imbalanced."""
    options = CacheAwareOptions()
    for index, score in enumerate(scores):
        pair = [min(scores), score]
        assert overloaded(scores, index, options) is imbalanced(
            pair, options.balance_abs_threshold, options.balance_rel_threshold)


def test_memory_is_capped_least_recently_used_first():
    servers = make_servers()
    a = affinity(servers, capacity=100)
    a.pick(b"old-but-used", servers)
    for n in range(1000):
        a.pick(f"s{n}".encode(), servers)
        if n % 50 == 0:
            a.pick(b"old-but-used", servers)  # used now and then: stays
    assert len(a) == 100
    before = a.counts["kept"]
    a.pick(b"old-but-used", servers)
    assert a.counts["kept"] == before + 1
    a.pick(b"s0", servers)  # long unused: forgotten, placed again
    assert a.counts["placed"] == 1 + 1000 + 1


def test_sessions_expire_after_the_ttl():
    servers = make_servers()
    clock = Clock()
    a = affinity(servers, ttl=60.0, clock=clock)
    a.pick(b"conv", servers)
    clock.now += 59
    a.pick(b"conv", servers)
    assert a.counts["kept"] == 1
    clock.now += 61
    a.pick(b"conv", servers)
    assert a.counts == {"kept": 1, "placed": 2, "moved": 0}
    for n in range(10):  # expired entries are dropped as new ones come
        a.pick(f"s{n}".encode(), servers)
        clock.now += 100
    assert len(a) <= 3
