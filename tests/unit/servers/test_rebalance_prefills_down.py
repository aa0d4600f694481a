"""Every prefill of a model down: a decode is switched to prefill after a whole window, when
the decodes can spare one; never with rebalancing off, never the last decode, within the
cool-down and the hourly budget. A down role serves nothing yet reads as an idle one (no
serving server, no pressure), so the pressures alone never moved a decode there."""

from __future__ import annotations

import asyncio

import pytest

from gateway.servers.pool import Server, ServerPool
from gateway.servers.rebalance import Move, RebalanceOptions, Rebalancer, without_prefill
from tests.unit.servers.test_rebalance import Counted, Switcher, server

WINDOW = 3.0


def fleet(decodes: int = 2, prefills: int = 1) -> ServerPool:
    pool = ServerPool()
    for i in range(prefills):
        pool.add(server(f"http://p{i}", "prefill"))
    for i in range(decodes):
        pool.add(server(f"http://d{i}", "decode"))
    return pool


def down(pool: ServerPool) -> None:
    for s in pool.role("prefill"):
        s.healthy = False


def run(r: Rebalancer, pool: ServerPool, start: float, until: float) -> None:
    """A reading every second of simulated time, from `start` to `until`."""
    async def steps() -> None:
        t = start
        while t <= until:
            for s in pool:
                s.load.updated_at = t
            await r.step(now=t)
            t += 1.0
    asyncio.run(steps())


def rebalancer(pool: ServerPool, switcher: Switcher, enabled: bool = True, **options):
    settings = {"window": WINDOW, "cooldown": 10.0, "per_hour": 6, "minimum": 1,
                "interval": 1.0, **options}
    return Rebalancer(pool, switcher, RebalanceOptions(enabled, 1.5, 0.06, **settings),
                      lambda: (0.0, 0.0), Counted())


@pytest.mark.parametrize(("since", "decodes", "minimum", "move"), [
    (0.0, 2, 1, Move("decode", "prefill", "prefill_down")),
    (None, 2, 1, None),  # a prefill serves
    (8.0, 2, 1, None),  # down for less than a window
    (0.0, 1, 1, None),  # the last decode
    (0.0, 2, 2, None),  # the decodes are at the minimum
], ids=["down-a-window", "prefill-serves", "short", "last-decode", "minimum"])
def test_without_prefill(since, decodes, minimum, move):
    servers = list(fleet(decodes))
    assert without_prefill(servers, since, 10.0, WINDOW, minimum) == move


def test_a_decode_becomes_a_prefill_once_every_prefill_was_down_a_window():
    pool, switcher = fleet(decodes=3, prefills=2), Switcher()
    down(pool)
    counted = Counted()
    r = rebalancer(pool, switcher)
    r.counted = counted
    run(r, pool, 1.0, WINDOW)
    assert switcher.asked == [], "not before a whole window"
    run(r, pool, WINDOW + 1, WINDOW + 1)
    assert len(switcher.asked) == 1 and switcher.asked[0][1] == "prefill"
    assert counted.seen == [("decode", "prefill", "prefill_down", "switched")]


def test_one_serving_prefill_or_rebalancing_off_moves_nothing():
    pool, switcher = fleet(decodes=3, prefills=2), Switcher()
    pool.role("prefill")[0].healthy = False  # one of two down: the other serves
    run(rebalancer(pool, switcher), pool, 1.0, 30.0)
    down(pool)
    run(rebalancer(pool, switcher, enabled=False), pool, 1.0, 30.0)
    assert switcher.asked == []


def test_refusals_keep_to_the_cool_down_and_the_budget():
    pool, switcher = fleet(decodes=3), Switcher(refuse=True)
    down(pool)
    r = rebalancer(pool, switcher, per_hour=2)
    run(r, pool, 1.0, 60.0)
    assert list(r.attempts) == [4.0, 14.0], "a window, a cool-down, then the budget"


def test_a_prefill_back_restarts_the_window():
    pool, switcher = fleet(decodes=3), Switcher()
    prefill: Server = pool.role("prefill")[0]
    down(pool)
    r = rebalancer(pool, switcher)
    run(r, pool, 1.0, WINDOW)  # down since 1
    prefill.healthy = True
    run(r, pool, WINDOW + 1, WINDOW + 1)  # a reading with it serving
    prefill.healthy = False
    run(r, pool, WINDOW + 2, 2 * WINDOW + 1)  # down again since 5: 8 is its window
    assert switcher.asked == []
    run(r, pool, 2 * WINDOW + 2, 2 * WINDOW + 2)
    assert len(switcher.asked) == 1


def test_a_prefill_an_operator_drains_is_not_down():
    pool, switcher = fleet(decodes=3), Switcher()
    pool.role("prefill")[0].draining = True  # drained by hand, healthy: on purpose
    run(rebalancer(pool, switcher), pool, 1.0, 30.0)
    assert switcher.asked == []
