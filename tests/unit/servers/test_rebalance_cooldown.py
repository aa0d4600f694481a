"""The rebalancer's cool-down runs from the end of a switch, not from its start.

Why: a switch drains its server first, which takes as long as the requests in flight there
(seconds under load, up to the drain deadline). Counted from the start, the drain ate the
cool-down: with `--rebalance-cooldown 5` a 2 s switch left 3 s, and a second server moved
while the first had barely joined its role (tests/reliability/test_rebalance.py,
test_with_workers_one_process_decides, "the roles read 1 decode within the cool-down")."""

from __future__ import annotations

import asyncio

from gateway.servers.rebalance import RebalanceOptions, Rebalancer
from tests.unit.servers.test_rebalance import Counted, pressed_fleet

SWITCH_TAKES = 4.0  # seconds of (simulated) drain and switch


class Clock:
    def __init__(self, at: float) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


class SlowSwitcher:
    """Accepts every switch after SWITCH_TAKES seconds on `clock`; records when each ended."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.ended: list[float] = []

    async def switch(self, ask) -> dict:
        self.clock.at += SWITCH_TAKES
        self.ended.append(self.clock.at)
        return {"waited_s": SWITCH_TAKES}


def test_the_cool_down_starts_when_the_switch_has_ended() -> None:
    pool, _ = pressed_fleet()
    clock = Clock(1.0)  # a snapshot at 0.0 reads as never taken
    switcher = SlowSwitcher(clock)
    options = RebalanceOptions(True, 1.0, 0.05, window=2, cooldown=5, per_hour=6, minimum=1,
                               interval=1)
    rebalancer = Rebalancer(pool, switcher, options, lambda: (0.0, 0.0), Counted(),
                            clock=clock)

    async def steps() -> None:
        while clock.at <= 30:
            for s in pool:
                s.load.updated_at = clock.at
            await rebalancer.step()
            clock.at += 1.0

    asyncio.run(steps())
    starts = list(rebalancer.attempts)
    assert starts[0] == 3.0 and switcher.ended[0] == 7.0  # a whole window, then 4 s
    assert len(starts) >= 2
    for ended, start in zip(switcher.ended, starts[1:], strict=False):
        assert start - ended >= options.cooldown, (starts, switcher.ended)
    assert starts[1] == 12.0  # the pressure held: the first reading past the cool-down
