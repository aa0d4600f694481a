"""The rebalancer's decisions without sockets: pressures from load figures, the window, the
hysteresis, the minimum, the cool-down, the hourly budget and the cheapest server."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import GatewayError
from gateway.servers.pool import Server, ServerPool
from gateway.servers.pressure import Pressure, PressureGauge, RolePressure
from gateway.servers.rebalance import Move, RebalanceOptions, Rebalancer, cheapest, decide


def reading(at: float, prefill: float, decode: float, n_prefill: int = 1,
            n_decode: int = 2) -> Pressure:
    return Pressure(RolePressure(prefill, n_prefill, "queue"),
                    RolePressure(decode, n_decode, "slots"), at)


@pytest.mark.parametrize(("history", "minimum", "move"), [
    ([reading(t, 2.0, 0.2) for t in (0, 1, 2, 3)], 1, Move("decode", "prefill", "prefill_queue")),
    ([reading(t, 2.0, 0.2) for t in (0, 1, 2)], 1, None),  # not a whole window yet
    ([reading(0, 0.5, 0.2), *(reading(t, 2.0, 0.2) for t in (1, 2, 3))], 1, None),  # a burst
    ([reading(t, 2.0, 0.5) for t in (0, 1, 2, 3)], 1, None),  # 0.5 x 2/1 = 1.0 > TARGET
    ([reading(t, 2.0, 0.2) for t in (0, 1, 2, 3)], 2, None),  # the decodes are the minimum
    ([reading(t, 2.0, 0.1, n_decode=1) for t in (0, 1, 2, 3)], 1, None),  # never below 1
    ([reading(t, 0.1, 1.5, 2, 1) for t in (0, 1, 2, 3)], 1,
     Move("prefill", "decode", "decode_slots")),
], ids=["pressed-window", "short-window", "burst", "giver-would-be-pressed", "minimum",
        "last-one", "other-way"])
def test_decide(history, minimum, move):
    assert decide(history, 3.0, minimum) == move


def test_the_itl_is_not_divided_by_more_decodes():
    """A slow step is not shortened by another decode: it neither projects as spread load
    nor lets the decodes give a server up while it is over its objective."""
    slow = RolePressure(1.2, 2, "itl", load=0.3)
    assert slow.needed(1) == 3 and slow.without_one() == float("inf")
    fine = RolePressure(0.7, 3, "itl", load=0.2)
    assert fine.without_one() == pytest.approx(0.3) and fine.needed(1) == 1


def server(url: str, role: str, *, in_flight: int = 0, used: int = 0) -> Server:
    s = Server(url, role, verified=True)
    s.in_flight, s.load.used_tokens = in_flight, used
    return s


def test_cheapest_to_drain():
    busy, cached, free = (server("http://a", "decode", in_flight=3),
                          server("http://b", "decode", used=900),
                          server("http://c", "decode", used=100))
    assert cheapest([busy, cached, free]) is free


def test_gauge_reads_busy_share_queue_and_slots():
    gauge = PressureGauge(ttft_s=1.0, itl_s=0.05)
    p, d = server("http://p", "prefill"), server("http://d", "decode")
    d.load.max_running_requests, d.load.running, d.load.waiting = 10, 6, 2
    p.load.prefill_speed, p.load.waiting_uncached_tokens = 1000.0, 250  # 0.25 s queued
    p.load.updated_at = d.load.updated_at = 100.0
    gauge.measure([p, d], (0.0, 0.0), now=100.0)
    p.load.prefill_busy_us, p.load.updated_at = 900_000, 101.0  # busy 0.9 s of 1 s
    d.load.updated_at = 101.0
    now = gauge.measure([p, d], (1.0, 20.0), now=101.0)  # mean gap 50 ms
    assert (now.prefill.value, now.prefill.signal) == (pytest.approx(0.9), "busy")
    assert (now.decode.value, now.decode.signal) == (pytest.approx(1.0), "itl")
    assert now.decode.spread == pytest.approx(0.8)


class Switcher:
    def __init__(self, refuse: bool = False) -> None:
        self.asked: list[tuple[str, str]] = []
        self.refuse = refuse

    async def switch(self, ask):
        self.asked.append((ask.url, ask.new_role))
        if self.refuse:
            raise GatewayError("not idle", code="role_switch_busy")
        return {"waited_s": 0.0}


class Counted:
    def __init__(self) -> None:
        self.seen: list[tuple[str, ...]] = []

    def labels(self, *values: str):
        self.seen.append(values)
        return self

    def inc(self) -> None:
        pass


def pressed_fleet() -> tuple[ServerPool, Server]:
    pool = ServerPool()
    p = server("http://p", "prefill")
    p.load.prefill_speed, p.load.waiting_uncached_tokens = 1000.0, 5000  # 5 s queued
    pool.add(p)
    for url, used in (("http://d1", 500), ("http://d2", 10), ("http://d3", 900)):
        d = server(url, "decode", used=used)
        d.load.max_running_requests = 10
        pool.add(d)
    return pool, p


def run_steps(rebalancer: Rebalancer, pool: ServerPool, until: float) -> None:
    async def steps() -> None:
        t = 1.0  # a snapshot at 0.0 reads as never taken
        while t <= until:
            for s in pool:
                s.load.updated_at = t
            await rebalancer.step(now=t)
            t += 1.0
    asyncio.run(steps())


def test_cool_down_and_hourly_budget_count_refused_attempts():
    pool, _ = pressed_fleet()
    switcher, counted = Switcher(refuse=True), Counted()
    options = RebalanceOptions(True, 1.0, 0.05, window=2, cooldown=10, per_hour=3,
                               minimum=1, interval=1)
    rebalancer = Rebalancer(pool, switcher, options, lambda: (0.0, 0.0), counted)
    run_steps(rebalancer, pool, until=60)
    times = [3.0, 13.0, 23.0]  # a window, then each after a cool-down; then the hour's budget is spent
    assert list(rebalancer.attempts) == times
    assert len(switcher.asked) == len(times)
    assert switcher.asked[0] == ("http://d2", "prefill")  # the least KV in use
    assert counted.seen[0] == ("decode", "prefill", "prefill_queue", "busy")
    assert rebalancer.desired[("default", "prefill")] > 1


def test_off_by_default_only_advises():
    pool, _ = pressed_fleet()
    switcher = Switcher()
    rebalancer = Rebalancer(pool, switcher, RebalanceOptions(), lambda: (0.0, 0.0), Counted())
    run_steps(rebalancer, pool, until=30)
    assert switcher.asked == []
    assert rebalancer.desired[("default", "prefill")] >= 2
