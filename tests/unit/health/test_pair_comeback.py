"""A pair quarantined for its failures is probed at once when one of its servers comes back.

With a single prefill, a dead decode's failures are the pair's (the prefill works with the
other decode, the dead one has no other partner to prove it at fault): the decode's comeback
(marked up, or verified again after a restart: `Server.comebacks`) ends the quarantine, so
the restarted decode is paired again without waiting out the cooldown."""

from __future__ import annotations

from gateway.health.checker import HealthChecker
from gateway.health.pairs import PairHealth
from gateway.servers.pool import Server, ServerPool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def one_prefill_quarantined() -> tuple[PairHealth, Server, Server, Clock]:
    """p works with d2; d1 fails with p three times: the pair (p, d1) is quarantined."""
    clock = Clock()
    pairs = PairHealth(threshold=3, cooldown=10, clock=clock)
    p, d1 = Server("http://p", "prefill", verified=True), Server("http://d1", "decode",
                                                                 verified=True)
    pairs.record_success(p.url, "http://d2")
    assert all(pairs.record_failure(p.url, d1.url, (p, d1)) for _ in range(3))
    assert pairs.blocked(p.url, d1.url)
    return pairs, p, d1, clock


def test_a_comeback_ends_the_quarantine_with_one_probe():
    pairs, p, d1, clock = one_prefill_quarantined()
    clock.now += 1
    d1.comebacks += 1  # its health checks found it back
    assert not pairs.blocked(p.url, d1.url), "probed at once, 9 s before the cooldown ends"
    pairs.probe(p.url, d1.url)
    assert pairs.blocked(p.url, d1.url), "one probe at a time"
    pairs.record_success(p.url, d1.url)
    assert pairs.quarantined() == []


def test_a_failed_probe_after_a_comeback_quarantines_again_for_longer():
    pairs, p, d1, clock = one_prefill_quarantined()
    d1.comebacks += 1
    pairs.probe(p.url, d1.url)
    assert pairs.record_failure(p.url, d1.url, (p, d1))
    assert pairs.blocked(p.url, d1.url)
    clock.now += 19
    assert pairs.blocked(p.url, d1.url), "the cooldown doubled to 20 s"
    clock.now += 1
    assert not pairs.blocked(p.url, d1.url)


def test_without_a_comeback_the_cooldown_holds():
    """A pair broken while both servers pass their checks (a dead transfer session) keeps
    its quarantine: the partner's comeback elsewhere is not this pair's."""
    pairs, p, d1, clock = one_prefill_quarantined()
    clock.now += 9.9
    assert pairs.blocked(p.url, d1.url)
    clock.now += 0.1
    assert not pairs.blocked(p.url, d1.url)


def test_the_health_checker_counts_a_comeback_when_it_marks_a_server_up():
    pool = ServerPool()
    server = pool.add(Server("http://d1", "decode", verified=True))
    checker = HealthChecker(pool, None, endpoint="/health", interval=1, timeout=1,
                            failures=2, successes=1, loads_interval=0)
    checker.record(server, False)
    checker.record(server, False)
    assert not server.healthy and server.comebacks == 0
    checker.record(server, True)
    assert server.healthy and server.comebacks == 1
    checker.record(server, True)
    assert server.comebacks == 1, "only a return counts"
